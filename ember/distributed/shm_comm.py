"""All-reduce and all-gather of CPU tensors among the ranks of one host, through shared
memory (the fast path vLLM's and SGLang's CPU builds have too), Gloo for the rest.

Rank 0 creates one segment in /dev/shm and the group's ranks map it (its name travels
over the process group, the file is removed once all have it, so nothing is left behind
whatever ends the processes): a slot of `max_bytes` per rank and two counters per rank.
A collective call number g (every rank makes the same calls in the same order):
    wait until every rank has read call g - 1's slots (its `read` counter >= g - 1)
    -> write the tensor's bytes to its own slot, then set its `written` counter to g
    -> wait until every rank's `written` counter is g
    -> read the slots: the sum in rank order (so every rank gets the same bits), or
       their concatenation; then set its `read` counter to g.
A rank's counter stores follow its slot's stores, and the other ranks see them in that
order on x86-64 (stores are not reordered with stores); other CPUs use Gloo for all.
Tensors that are not on the CPU, not contiguous, or larger than `max_bytes` go to
`torch.distributed` over the group (Gloo on CPU, the fallback and the multi-host path).

Data-parallel attention's row collectives use the same slots, each rank writing rows of
its own count: `all_gather_rows` (every rank knows every rank's count), and
`reduce_scatter_rows` (each rank sums, in rank order, only its own rows of every slot);
`all_to_all_rows` puts the rows it sends each rank in its slot behind a header of the
counts, and each rank reads its part of every slot. Whether a call fits the slots is
decided from figures every rank has (the counts, or the most rows any rank sends), so
that all ranks take the same path.
"""

from __future__ import annotations

import os
import platform
import uuid
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

SHM_DIR = "/dev/shm"
NAME_BYTES = 256  # room for the segment's path
# stores seen by other cores in program order (TSO)
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


class ShmCommunicator:
    def __init__(
        self,
        group: dist.ProcessGroup | None = None,
        max_bytes: int = 16 << 20,
        shared_memory: bool = True,
    ) -> None:
        """`shared_memory` False: the group's ranks are not on one host (Gloo for all)."""
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_bytes = max_bytes
        self.enabled = (
            shared_memory and ORDERED_STORES and os.path.isdir(SHM_DIR) and self.world_size > 1
        )
        self.num_calls = 0
        # called every CHECK_SPINS spins of a wait: raises if a peer is gone (else the
        # wait would spin forever; ember.distributed.executor watches the processes)
        self.check: Callable[[], None] | None = None
        if not self.enabled:
            return
        header = 2 * self.world_size * 8  # int64 counters: written, read
        slot = -(-max_bytes // 64) * 64
        size = header + self.world_size * slot
        name = torch.zeros(NAME_BYTES, dtype=torch.uint8)  # its name, as bytes (no pickle)
        if self.rank == 0:
            path = os.path.join(SHM_DIR, f"ember-comm-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
            name[: len(path)] = torch.frombuffer(bytearray(path.encode()), dtype=torch.uint8)
        dist.broadcast(name, src=dist.get_global_rank(group, 0) if group else 0, group=group)
        path = bytes(name.numpy()).rstrip(b"\0").decode()
        try:
            memory = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
        finally:
            dist.barrier(group=group)  # every rank has mapped it (or failed to)
            if self.rank == 0:
                os.unlink(path)
        counters = memory[:header].view(torch.int64).view(2, self.world_size)
        self._written, self._read = counters.numpy()  # polled without torch's overhead
        self._slots = memory[header:].view(self.world_size, slot)

    def close(self) -> None:
        self._slots = self._written = self._read = None
        self.enabled = False

    def _fast(self, tensor: torch.Tensor) -> bool:
        return (
            self.enabled
            and tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and tensor.numel() * tensor.element_size() <= self.max_bytes
        )

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sums `tensor` over the ranks, in place (and returns it)."""
        if not self._fast(tensor):
            dist.all_reduce(tensor, group=self.group)
            return tensor
        parts = self._exchange(tensor)
        out = tensor.view(-1)  # its bytes are in this rank's slot already
        torch.add(parts[0], parts[1], out=out)  # in rank order: the same bits everywhere
        for part in parts[2:]:
            out.add_(part)
        self._done()
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor`, concatenated along dim 0 in rank order (a 0-d tensor's
        values stacked)."""
        if not self._fast(tensor):
            parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
            dist.all_gather(parts, tensor.contiguous(), group=self.group)
            return torch.cat([p.reshape(-1, *tensor.shape[1:]) for p in parts])
        parts = self._exchange(tensor)
        out = torch.cat(parts).view(-1, *tensor.shape[1:])
        self._done()
        return out

    def all_gather_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows ([counts[r], ...] from rank r, every rank knowing `counts`),
        concatenated in rank order."""
        rest = tensor.shape[1:]
        row = rest.numel()
        sizes = [count * row for count in counts]
        if not self._fits(max(sizes) * tensor.element_size(), tensor):
            padded = tensor.new_zeros(max(counts), *rest)
            padded[: len(tensor)] = tensor
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded, group=self.group)
            return torch.cat([part[:count] for part, count in zip(parts, counts, strict=True)])
        parts = self._exchange(tensor, sizes)
        out = torch.cat(parts).view(-1, *rest)
        self._done()
        return out

    def reduce_scatter_rows(self, tensor: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The sum over ranks of `tensor` ([sum(counts), ...], the same shape on every
        rank), of which this rank gets its rows: counts[rank] rows from sum(counts[:rank])."""
        start, num = sum(counts[: self.rank]), counts[self.rank]
        if not self._fast(tensor):
            dist.all_reduce(tensor, group=self.group)
            return tensor[start : start + num].clone()
        row = tensor.shape[1:].numel()
        parts = [part[start * row : (start + num) * row] for part in self._exchange(tensor)]
        out = torch.add(parts[0], parts[1])  # in rank order, as all_reduce
        for part in parts[2:]:
            out.add_(part)
        self._done()
        return out.view(num, *tensor.shape[1:])

    def all_to_all_rows(
        self, tensor: torch.Tensor, splits: list[int], max_rows: int
    ) -> tuple[torch.Tensor, list[int]]:
        """Sends rows [sum(splits[:d]), sum(splits[:d + 1])) of `tensor` to rank d; returns
        the rows every rank sent this one, in rank order, and how many came from each.
        `max_rows`: the most rows any rank sends (every rank passes the same), which
        decides the path all ranks take."""
        rest = tensor.shape[1:]
        row = rest.numel()
        header = 8 * self.world_size
        if not self._fits(header + max_rows * row * tensor.element_size(), tensor):
            return self._all_to_all_gloo(tensor, splits, max_rows)
        self.num_calls += 1
        call, rank = self.num_calls, self.rank
        _wait(self._read, call - 1, self.check)
        slot = self._slots[rank]
        slot[:header].view(torch.int64).copy_(torch.tensor(splits, dtype=torch.int64))
        data = tensor.reshape(-1).view(torch.uint8)
        slot[header : header + len(data)].copy_(data)
        self._written[rank] = call
        _wait(self._written, call, self.check)
        parts, counts = [], []
        for source in range(self.world_size):
            theirs = self._slots[source, :header].view(torch.int64).tolist()
            first = header + sum(theirs[:rank]) * row * tensor.element_size()
            num_bytes = theirs[rank] * row * tensor.element_size()
            parts.append(self._slots[source, first : first + num_bytes].view(tensor.dtype))
            counts.append(theirs[rank])
        out = torch.cat(parts).view(-1, *rest)
        self._done()
        return out, counts

    def _all_to_all_gloo(self, tensor, splits, max_rows):
        """all_to_all_rows through torch.distributed: the counts, then every rank's rows
        padded to `max_rows` (an all-gather: what any backend has)."""
        counts = self.all_gather(torch.tensor(splits, dtype=torch.int64)).view(self.world_size, -1)
        padded = tensor.new_zeros(max_rows, *tensor.shape[1:])
        padded[: len(tensor)] = tensor
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        dist.all_gather(parts, padded, group=self.group)
        mine = counts[:, self.rank].tolist()
        starts = counts[:, : self.rank].sum(dim=1).tolist()
        out = [part[a : a + n] for part, a, n in zip(parts, starts, mine, strict=True)]
        return torch.cat(out), mine

    def _fits(self, num_bytes: int, tensor: torch.Tensor) -> bool:
        return self.enabled and tensor.device.type == "cpu" and num_bytes <= self.max_bytes

    def _exchange(self, tensor: torch.Tensor, sizes: list[int] | None = None) -> list[torch.Tensor]:
        """Writes `tensor` to this rank's slot; once every rank has, each rank's as views
        (valid until `_done`): of as many elements as this rank's, or of `sizes[r]`."""
        self.num_calls += 1
        call, rank = self.num_calls, self.rank
        _wait(self._read, call - 1, self.check)  # the slots of the call before are free
        size = tensor.element_size()
        num_bytes = tensor.numel() * size
        flat = tensor.reshape(-1)
        self._slots[rank, :num_bytes].copy_(flat.view(torch.uint8))
        self._written[rank] = call
        _wait(self._written, call, self.check)
        sizes = sizes or [tensor.numel()] * self.world_size
        return [
            self._slots[r, : sizes[r] * size].view(tensor.dtype) for r in range(self.world_size)
        ]

    def _done(self) -> None:
        self._read[self.rank] = self.num_calls


CHECK_SPINS = 4096  # a few ms of spinning


def _wait(counters: np.ndarray, call: int, check: Callable[[], None] | None) -> None:
    """Spins until every rank's counter has reached `call`."""
    spins = 0
    while counters.min() < call:
        spins += 1
        if spins % CHECK_SPINS == 0:
            os.sched_yield()  # a peer sharing this core gets it
            if check is not None:
                check()

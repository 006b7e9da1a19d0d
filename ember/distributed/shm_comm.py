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
# stores seen by other cores in program order (TSO)
ORDERED_STORES = platform.machine().lower() in ("x86_64", "amd64")


class ShmCommunicator:
    def __init__(self, group: dist.ProcessGroup | None = None, max_bytes: int = 16 << 20):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_bytes = max_bytes
        self.enabled = ORDERED_STORES and os.path.isdir(SHM_DIR) and self.world_size > 1
        self.num_calls = 0
        # called every CHECK_SPINS spins of a wait: raises if a peer is gone (else the
        # wait would spin forever; ember.distributed.executor watches the processes)
        self.check: Callable[[], None] | None = None
        if not self.enabled:
            return
        header = 2 * self.world_size * 8  # int64 counters: written, read
        slot = -(-max_bytes // 64) * 64
        size = header + self.world_size * slot
        name = [None]
        if self.rank == 0:
            name[0] = os.path.join(SHM_DIR, f"ember-comm-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            fd = os.open(name[0], os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            os.ftruncate(fd, size)
            os.close(fd)
        dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)  # fmt: skip
        try:
            memory = torch.from_file(name[0], shared=True, size=size, dtype=torch.uint8)
        finally:
            dist.barrier(group=group)  # every rank has mapped it (or failed to)
            if self.rank == 0:
                os.unlink(name[0])
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

    def _exchange(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Writes `tensor` to this rank's slot; once every rank has, each rank's as views
        (valid until `_done`)."""
        self.num_calls += 1
        call, rank = self.num_calls, self.rank
        _wait(self._read, call - 1, self.check)  # the slots of the call before are free
        num_bytes = tensor.numel() * tensor.element_size()
        flat = tensor.reshape(-1)
        self._slots[rank, :num_bytes].copy_(flat.view(torch.uint8))
        self._written[rank] = call
        _wait(self._written, call, self.check)
        return [
            self._slots[r, :num_bytes].view(tensor.dtype).view(-1) for r in range(self.world_size)
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

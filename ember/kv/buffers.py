"""An engine's KV tensors seen as blocks of bytes, and where they live.

The model runner keeps one tensor per layer, `[parts, num_blocks, block_size, heads,
head_dim]` (engine.kv_spec: two parts, keys and values, or one, MLA's latent), so block b
of layer l is one contiguous chunk per part. Blocks move layer by layer: for each layer,
part by part (keys then values), for each block in the order given; runs of consecutive
block ids are moved as one chunk.

A prefill worker on one host with its decode workers keeps its KV tensors in one file in
/dev/shm (mode 0600, removed when the engine stops), so a decode worker can copy blocks
out of it directly (the shared-memory transport).

Nothing is written at allocation: on CPU the tensors are views of an anonymous mapping
(or of that file, sized with ftruncate), whose pages the OS hands out, zeroed, when a
step first writes to them. A 4 GB pool costs no time and no memory at start. Pages taken
inside a step are dear, though (measured on a 2-core VM: 180k page faults cost a
40-request trace 1.2-2 s of its ~10 s), so an idle engine hands the pool its pages ahead
of use, a couple of milliseconds at a time, lowest block ids first (the order the block
pool gives them out): `Prefaulter`. The anonymous mapping is advised onto 2 MB pages
(`EMBER_HUGE_PAGES`, as the decode weights are). On CUDA the pool is zeroed (a device memset, about a
millisecond per 10 GB): the SDPA decode path reads the masked-off tail of a sequence's
last block, and a masked NaN left by an earlier allocation would still poison it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence

import torch

SHM_DIR = "/dev/shm"
MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault pages in, writable, leaving their contents
MADV_COLLAPSE = 25  # Linux 6.1+: a range's pages onto 2 MB pages now, contents kept
HUGE_PAGE = 2 << 20  # (ember.models.huge_pages.HUGE_PAGE, which this module imports late)
logger = logging.getLogger(__name__)


def allocate(shape: tuple[int, ...], num_layers: int, dtype: torch.dtype, device, shm: bool):
    """Per-layer KV tensors, untouched (module docstring); with `shm`, views of one
    shared-memory file (path returned)."""
    numel = num_layers * _numel(shape)
    if torch.device(device).type != "cpu":
        return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)], None
    if not shm or not os.path.isdir(SHM_DIR):
        flat = _anonymous(numel * dtype.itemsize).view(dtype)
        return list(flat.view(num_layers, *shape).unbind(0)), None
    tensors, path, _ = allocate_shared([shape] * num_layers, dtype)
    return tensors, path


def allocate_shared(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype
) -> tuple[list[torch.Tensor], str, list[int]]:
    """Tensors of these shapes in one new shared-memory file, each at a page boundary:
    (the tensors, the file's path, each one's byte offset). A model's ranks keep their
    KV so (ember.kv.layout), each mapping the file (`map_shared`)."""
    offsets, end = [], 0
    for shape in shapes:
        offsets.append(end)
        end += -(-_numel(shape) * dtype.itemsize // mmap.PAGESIZE) * mmap.PAGESIZE
    if not os.path.isdir(SHM_DIR):
        raise ValueError(f"a KV cache over several ranks needs {SHM_DIR} (shared memory)")
    stat = os.statvfs(SHM_DIR)
    if stat.f_bavail * stat.f_frsize < end:
        raise ValueError(
            f"the KV cache ({end / 1e9:.2f} GB over every rank) does not fit the free space "
            f"of {SHM_DIR} ({stat.f_bavail * stat.f_frsize / 1e9:.2f} GB): lower "
            f"kv_cache_memory, or give {SHM_DIR} more room (docker: --shm-size)"
        )
    remove_stale_shm()
    path = os.path.join(SHM_DIR, f"ember-kv-{os.getpid()}-{secrets.token_hex(4)}")
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, max(end, 1))  # tmpfs: zero-filled, pages on first touch
    finally:
        os.close(fd)
    return map_shared(path, shapes, offsets, dtype), path, offsets


def map_shared(
    path: str, shapes: Sequence[tuple[int, ...]], offsets: Sequence[int], dtype: torch.dtype
) -> list[torch.Tensor]:
    """Views of the tensors `allocate_shared` made (or another engine's, same layout)."""
    size = os.path.getsize(path)
    raw = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    tensors = []
    for shape, offset in zip(shapes, offsets, strict=True):
        num_bytes = _numel(shape) * dtype.itemsize
        if offset < 0 or offset % dtype.itemsize or offset + num_bytes > size:
            raise ValueError(f"{path} does not hold a KV cache of this layout")
        tensors.append(raw[offset : offset + num_bytes].view(dtype).view(shape))
    return tensors


def _anonymous(num_bytes: int) -> torch.Tensor:
    """Bytes of a private anonymous mapping: zero pages, each allocated on first touch.
    (torch.zeros would write every page now; torch.empty gives no such promise.) Advised
    onto 2 MB pages where ember.models.huge_pages applies: a decode step reads each
    sequence's blocks from all over the pool, and on 4 KB pages every block crossed a TLB
    entry or two (6 sequences of 1,500 tokens, 30 layers: decode steps 23.5-26.4 ->
    22.5-23.1 ms on the 2-core AMX Xeon, docs/benchmarks.md)."""
    from ember.models import huge_pages  # (the engine core's: not at import, for the others)

    if huge_pages.applies() and num_bytes:
        return huge_pages.huge_page_buffer(num_bytes)
    memory = mmap.mmap(-1, max(num_bytes, 1), flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(memory, dtype=torch.uint8, count=num_bytes)  # keeps `memory` alive


def remove_stale_shm() -> None:
    """Removes the KV files of engines that are gone (killed before they could)."""
    for name in os.listdir(SHM_DIR):
        if not name.startswith("ember-kv-"):
            continue
        pid = name.split("-")[2]
        if pid.isdigit() and not _alive(int(pid)):
            remove_shm(os.path.join(SHM_DIR, name))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_shm(path: str | None) -> None:
    if path is not None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """Consecutive block ids as (first, count) runs."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


def chunks(kv_caches: Sequence[torch.Tensor], block_ids: Sequence[int]) -> Iterator[memoryview]:
    """The bytes of `block_ids` in transfer order, as writable views into the tensors."""
    block_runs = runs(block_ids)
    for layer in kv_caches:
        for kv in range(layer.shape[0]):
            for first, count in block_runs:
                part = layer[kv, first : first + count]
                yield memoryview(part.view(torch.uint8).numpy()).cast("B")


class DeviceBlocks:
    """Whole blocks of KV tensors that live on a device (CUDA), gathered into and
    scattered from one uint8 tensor on that device, a block a row, each row the block's
    bytes in transfer order (what `chunks` gives for one block on CPU, so a block's bytes
    mean the same on either). The rows move to and from host memory as single copies.

    `gather` runs on the calling thread's stream (the engine's, between steps);
    `scatter` on a stream of the calling thread's own (`stream()`: a loader thread's),
    waiting for its copies before it returns, so a load overlaps steps and is whole once
    it returns."""

    def __init__(self, kv_caches: Sequence[torch.Tensor]) -> None:
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        self.block_bytes = block_bytes(kv_caches)
        self._local = threading.local()

    def stream(self):
        """A context in which this thread's copies go on its own stream (CUDA)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream(self.device)
        return torch.cuda.stream(stream)

    def rows(self, count: int) -> torch.Tensor:
        return torch.empty((count, self.block_bytes), dtype=torch.uint8, device=self.device)

    def _parts(self) -> Iterator[tuple[torch.Tensor, int, int]]:
        """(part [num_blocks, ...], its bytes' offset in a row, their width)."""
        offset = 0
        for layer in self.kv_caches:
            for part in layer:  # keys then values, or the latent
                width = part[0].numel() * part.element_size()
                yield part, offset, width
                offset += width

    def gather(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' bytes, a row each."""
        ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        out = self.rows(len(ids))
        for part, offset, width in self._parts():
            out[:, offset : offset + width] = (
                part.index_select(0, ids).view(len(ids), -1).view(torch.uint8)
            )
        return out

    def scatter(self, block_ids: Sequence[int], rows: torch.Tensor) -> None:
        """Writes rows (as `gather` gives them, on the device) into the blocks; returns
        once they are written."""
        with self.stream():
            ids = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
            for part, offset, width in self._parts():
                piece = rows[:, offset : offset + width].contiguous().view(part.dtype)
                part.index_copy_(0, ids, piece.view(len(ids), *part.shape[1:]))
            if self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()


class Prefaulter:
    """Takes the pages of a CPU KV pool's blocks before any step writes to them, `step()`
    by `step()`. The work is a list of pieces, lowest block ids first: each range of
    blocks that `range_bytes` of one part (a layer's keys or values) holds, in every part
    in turn; a step takes pieces until `slice_seconds` have passed (at least one), so
    that a request arriving meanwhile waits about that long, whatever taking a page
    costs on this machine (8 ms per 32 MB on one 2-core box, 70 on a fresh VM whose host
    hands out its memory on first touch, where 32 MB slices held the first chat
    completions after a start back by 50-150 ms). Contents are never changed: the
    kernel's MADV_POPULATE_WRITE faults pages in as they are; where that is missing, each
    page gets a byte ORed with 0. Call it only between steps (the engine core's own
    thread).

    `small_heads`, for a pool advised onto 2 MB pages (huge_pages): the 2 MB pages that
    hold the first `range_bytes` of each part are advised back onto 4 KB pages until the
    whole pool has its pages, then collapsed onto 2 MB pages again (MADV_COLLAPSE, Linux
    6.1+; a region a step). A request sent as a server comes up writes the lowest blocks
    of every part before the prefaulter has reached them: on a fresh VM each of those
    first writes took a 2 MB page, 4-9 ms (60 parts: ~250 ms of the first chat
    completion's step), where a 4 KB page costs microseconds."""

    def __init__(
        self,
        kv_caches: Sequence[torch.Tensor],
        range_bytes: int = 2 << 20,
        slice_seconds: float = 0.002,
        small_heads: bool = False,
    ) -> None:
        layers = [layer for layer in kv_caches if layer.device.type == "cpu"]
        self.parts = [part for layer in layers for part in layer]
        self.num_blocks = layers[0].shape[1] if layers else 0
        part_block = max((part[0].nbytes for part in self.parts), default=0)
        self.blocks_per_range = max(1, range_bytes // part_block) if part_block else 1
        self.slice_seconds = slice_seconds
        self.next_block = 0  # the first block of the range being taken
        self.next_part = 0  # the part of that range taken next
        self._madvise = _libc_madvise()  # (None once MADV_POPULATE_WRITE failed)
        self._libc_madvise = self._madvise
        # the parts' first 2 MB pages, on 4 KB pages until the pool has all its pages
        self.heads = _head_regions(self.parts, range_bytes) if small_heads else []
        self.heads = [h for h in self.heads if self._advise(*h, mmap.MADV_NOHUGEPAGE)]
        self._to_collapse = list(reversed(self.heads))
        self._collapse = True  # until the kernel refuses MADV_COLLAPSE

    @property
    def done(self) -> bool:
        return self.next_block >= self.num_blocks and not self._to_collapse

    def step(self) -> bool:
        """Faults in the next pieces (then collapses the heads); False once the whole pool
        has its pages."""
        deadline = time.perf_counter() + self.slice_seconds
        while self.next_block < self.num_blocks:
            last = min(self.next_block + self.blocks_per_range, self.num_blocks)
            self._populate(self.parts[self.next_part][self.next_block : last])
            self.next_part += 1
            if self.next_part == len(self.parts):
                self.next_part, self.next_block = 0, last
            if time.perf_counter() >= deadline:
                return not self.done
        while self._to_collapse:
            start, length = self._to_collapse.pop()
            self._advise(start, length, mmap.MADV_HUGEPAGE)
            if self._collapse and not self._advise(start, length, MADV_COLLAPSE):
                self._collapse = False  # an older kernel, or THP off: advised only
            if time.perf_counter() >= deadline:
                break
        return not self.done

    def _advise(self, start: int, length: int, advice: int) -> bool:
        """madvise on [start, start + length); whether the kernel took it."""
        madvise = self._libc_madvise
        return madvise is not None and madvise(start, length, advice) == 0

    def _populate(self, part: torch.Tensor) -> None:
        if self._madvise is not None:
            page = mmap.PAGESIZE
            start = part.data_ptr() // page * page
            length = part.data_ptr() + part.nbytes - start
            if self._madvise(start, length, MADV_POPULATE_WRITE) == 0:
                return
            logger.debug(
                "MADV_POPULATE_WRITE failed (errno %d): touching pages", ctypes.get_errno()
            )
            self._madvise = None
        raw = part.reshape(-1).view(torch.uint8)
        raw[:: mmap.PAGESIZE].bitwise_or_(0)  # a write that keeps every byte as it was


def _head_regions(parts: Sequence[torch.Tensor], head_bytes: int) -> list[tuple[int, int]]:
    """The 2 MB-aligned (start, length) regions that hold each part's first `head_bytes`,
    adjacent and overlapping ones merged."""
    regions: list[tuple[int, int]] = []
    for part in sorted(parts, key=torch.Tensor.data_ptr):
        start = part.data_ptr() // HUGE_PAGE * HUGE_PAGE
        end = -(-(part.data_ptr() + min(head_bytes, part.nbytes)) // HUGE_PAGE) * HUGE_PAGE
        if regions and start <= sum(regions[-1]):
            last_start, last_length = regions.pop()
            start, end = last_start, max(end, last_start + last_length)
        regions.append((start, end - start))
    return regions


def _libc_madvise():
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def block_bytes(kv_caches: Sequence[torch.Tensor]) -> int:
    """Bytes of one block over all layers (tensors)."""
    return sum(t.shape[0] * t[0, 0].numel() * t.element_size() for t in kv_caches)


def node_id() -> str:
    """This host's identity for "may we share memory?": the kernel's boot id and the
    device of /dev/shm (containers on one host, e.g. two pods on one node, share the boot
    id but each has a /dev/shm of its own)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat(SHM_DIR).st_dev}"
    except OSError:
        return ""

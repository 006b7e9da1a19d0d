"""The GGUF blocks a decode step streams, moved into one mapping of 2 MB pages.

A decode step of a small model reads every matmul's blocks once (SmolLM2's Q4_1 file: 92
MB a token, more than this kind of CPU's cache holds), so it runs at the memory's
streaming rate. On 4 KB pages that stream crosses a page, and a TLB entry, every 4 KB,
and the CPU's prefetchers stop at each crossing; Linux backs an anonymous mapping with 2
MB pages where it is advised to (MADV_HUGEPAGE) before it is touched, which transparent
huge pages in their default `madvise` mode honour. The blocks of a matmul are a few
hundred KB to a few MB each, below what the allocator would give such pages to, so they
go into one mapping together. Measured on a 2-core Intel Xeon (docs/benchmarks.md): the
default model's matmuls and head streamed in 4.8 ms a token instead of 5.4-5.6.

On Linux unless `EMBER_HUGE_PAGES=0`; where the kernel refuses the advice the blocks
still move, onto plain pages. The mapping counts in a model's planned weight bytes
(`max_rank_memory`) as it counts once loaded.
"""

from __future__ import annotations

import logging
import mmap

import torch
from torch import nn

from ember import envs

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
ALIGN = 4096  # each tensor's start in the mapping: a page, as a tensor of its own had


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def applies() -> bool:
    """Whether gather_blocks moves blocks here (asked for, and Linux has the advice)."""
    return envs.huge_pages() and hasattr(mmap, "MADV_HUGEPAGE")


def mapping_bytes(sizes: list[int]) -> int:
    """What the mapping for blocks of these byte sizes holds (gather_blocks; each rounded
    up to ALIGN, the whole to 2 MB, and 2 MB more to start on a boundary): the bytes a
    model's planned weights count for them (planned_weight_bytes)."""
    nbytes = sum(_round_up(size, ALIGN) for size in sizes)
    return _round_up(nbytes, HUGE_PAGE) + HUGE_PAGE if nbytes else 0


def huge_page_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] in a fresh anonymous mapping (mapping_bytes([nbytes]) long) advised
    MADV_HUGEPAGE, its start on a 2 MB boundary. Linux only (applies())."""
    length = mapping_bytes([nbytes])
    # private: a shared anonymous mapping is shmem, which THP leaves alone by default
    mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # THP off in this kernel: plain pages, as before
        logger.debug("MADV_HUGEPAGE refused", exc_info=True)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping alive
    start = (-whole.data_ptr()) % HUGE_PAGE
    return whole[start : start + nbytes]


def _block_holders(model: nn.Module) -> list[tuple[nn.Module, list[torch.Tensor]]]:
    """The matmuls (ember.models.layers.Linear) holding blocks, and their blocks."""
    return [
        (module, module.block_list)
        for module in model.modules()
        if getattr(module, "block_list", None)
    ]


def gather_blocks(model: nn.Module) -> int:
    """Moves every matmul's GGUF blocks (plain or tiled; Linear.block_list) into one
    huge-page mapping, the same bytes, the same shapes; returns the bytes moved (0: none,
    or not applies()). Call after packing (Linear.pack_for_cpu), before anything keeps
    references to the blocks (FusedDecode)."""
    holders = _block_holders(model)
    parts = [part for _, blocks in holders for part in blocks]
    if not applies() or not parts or any(p.device.type != "cpu" for p in parts):
        return 0
    sizes = [part.numel() * part.element_size() for part in parts]
    slots = [_round_up(size, ALIGN) for size in sizes]  # each part's room in the mapping
    buffer = huge_page_buffer(sum(slots))
    copies, offset = [], 0
    for part, size, slot in zip(parts, sizes, slots, strict=True):
        copies.append(buffer[offset : offset + size].view(part.dtype).view(part.shape))
        copies[-1].copy_(part)
        offset += slot
    moved = iter(copies)
    for module, blocks in holders:
        new = [next(moved) for _ in blocks]
        if module.blocks is not None:
            module.blocks = new[0]
        else:
            module.block_parts = new
    return sum(sizes)

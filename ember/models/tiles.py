"""GGUF blocks of 32 weights regrouped into the int8 GEMM's tiles of 16 output features
(ember/engine/kernels/int8_tiles.cpp), the layout decode steps multiply: which blocks
tile, and the regrouping, by the CPU kernels' one pass or by torch's copies."""

from __future__ import annotations

import torch

# Blocks tile_blocks regroups, by bytes per block: (fp16 fields (d, m), bytes of fifth bits)
TILE_FORMATS = {18: (1, 0), 20: (2, 0), 22: (1, 4), 24: (2, 4), 34: (1, 0)}
TILE_FEATURES = 16


def tile_blocks(blocks: torch.Tensor, kernels=None) -> torch.Tensor:
    """GGUF blocks regrouped into the int8 GEMM's tiles (`tile_blocks_torch`): by the CPU
    kernels' `tile_blocks_into` where given (one pass, on every thread: SmolLM2's in a
    tenth of the time), else by torch's permuted copies."""
    if kernels is None or not hasattr(kernels, "tile_blocks_into"):
        return tile_blocks_torch(blocks)
    rows, per_row, size = blocks.shape
    tiles = torch.empty(rows // TILE_FEATURES, per_row, TILE_FEATURES, size, dtype=torch.uint8)
    kernels.tile_blocks_into(blocks.contiguous(), tiles)
    return tiles


def tile_blocks_torch(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks of 32 weights, uint8 [out_features, blocks per row, bytes per block]
    (Q4_0, Q4_1, Q5_0, Q5_1 or Q8_0; out_features a multiple of 16), regrouped into the
    int8 GEMM's tiles (int8_tiles.cpp): [out / 16, blocks per row, 16, bytes], the same
    bytes. At each tile's block column come the 16 features' d (then m), their fifth bits
    (Q5_0 / Q5_1: a word each, byte c holding those of weights 4c..4c+3 and 16+4c..
    16+4c+3), then their codes as 4-byte words, word c of all 16 together."""
    rows, per_row, size = blocks.shape
    fields, fifth = TILE_FORMATS[size]
    tiles = blocks.view(rows // TILE_FEATURES, TILE_FEATURES, per_row, size)
    header = 2 * fields
    parts = [tiles[..., :header].unflatten(3, (fields, 2))]
    if fifth:  # the file's u32 qh: bit i is weight i's fifth bit
        qh = tiles[..., header : header + 4].to(torch.int64)
        qh = qh[..., 0] | qh[..., 1] << 8 | qh[..., 2] << 16 | qh[..., 3] << 24
        out = torch.zeros_like(qh)
        for c in range(4):
            for t in range(4):
                out |= ((qh >> (4 * c + t)) & 1) << (8 * c + t)
                out |= ((qh >> (16 + 4 * c + t)) & 1) << (8 * c + 4 + t)
        word = torch.stack([(out >> (8 * i)) & 0xFF for i in range(4)], dim=-1)
        parts.append(word.to(torch.uint8).unsqueeze(3))
    parts.append(tiles[..., header + fifth :].unflatten(3, ((size - header - fifth) // 4, 4)))
    # each [tiles, 16, blocks, fields or words, bytes]: features innermost but for the bytes
    out = torch.cat([part.permute(0, 2, 3, 1, 4).flatten(2) for part in parts], dim=2)
    return out.view(rows // TILE_FEATURES, per_row, TILE_FEATURES, size)


def tiles_apply(parts: list[torch.Tensor]) -> bool:
    """Whether every part of a W's blocks can be tiled (tile_blocks: Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0 with out_features a multiple of 16)."""
    return bool(parts) and all(
        part.dim() == 3 and part.shape[2] in TILE_FORMATS and part.shape[0] % TILE_FEATURES == 0
        for part in parts
    )

"""Dequantizing GGUF tensors: ember's C++ decoders where they are built, the common
block types in torch otherwise, the rest through gguf-py.

gguf-py's reference code is plain single-threaded numpy. Where ember's CPU kernels are
built already, `dequantize_blocks` decodes every block type the decode steps read
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) with the block GEMM's own decoders;
otherwise Q4_0, Q4_1 and Q8_0 (what small default models ship as) go through the same
float32 arithmetic in torch ops. Either way the results are gguf-py's, bit for bit, and
several times faster at load time.

Block layouts (fp16 scale d, fp16 minimum m, 4-bit q low nibbles first, then high):
    Q4_0  [d | 16 bytes of q]          w = d * (q - 8)
    Q4_1  [d | m | 16 bytes of q]      w = d * q + m
    Q8_0  [d | 32 int8 q]              w = q * d
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

from ember.engine.kernels import built_cpu_kernels

_QT = gguf.GGMLQuantizationType


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return _half(blocks, 0) * q.float()


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    return _half(blocks, 0) * _nibbles(blocks[:, 4:]).float() + _half(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * _half(blocks, 0)


_TORCH_KERNELS = {_QT.Q4_0: _q4_0, _QT.Q4_1: _q4_1, _QT.Q8_0: _q8_0}


# The block formats ember's block GEMM decodes to exactly the fp32 weights the loader
# gives (each is told apart by its bytes per block: ember/engine/kernels/block_gemm.cpp);
# its C++ decoders (`dequantize_blocks`) read the same.
BLOCK_FORMATS = frozenset({
    _QT.Q4_0, _QT.Q4_1, _QT.Q5_0, _QT.Q5_1, _QT.Q8_0,  # 32 weights per block
    _QT.Q4_K, _QT.Q5_K, _QT.Q6_K,  # 256 weights per super-block
})  # fmt: skip
# the 32-weight formats, which the int8 tiles take (ember.models.tiles.tile_blocks)
TILED_FORMATS = frozenset({_QT.Q4_0, _QT.Q4_1, _QT.Q5_0, _QT.Q5_1, _QT.Q8_0})


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 values of `data` (rows of raw blocks, as gguf gives them)."""
    kernels = built_cpu_kernels() if qtype in BLOCK_FORMATS else None
    kernel = _TORCH_KERNELS.get(qtype)
    if kernels is None and kernel is None:
        return gguf.quants.dequantize(data, qtype)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(-1, type_size)
    if kernels is not None:
        weights = kernels.dequantize_blocks(blocks.unsqueeze(0))
    else:
        weights = kernel(blocks)
    return weights.reshape(*data.shape[:-1], -1).numpy()

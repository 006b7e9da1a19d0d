"""Dequantizing GGUF tensors: the common block types in torch, the rest through gguf-py.

gguf-py's reference code is plain single-threaded numpy; for Q4_0, Q4_1 and Q8_0 (what
small default models ship as) ember does the same float32 arithmetic with torch ops,
which run on every core: bit-identical results, a few times faster at load time.

Block layouts (fp16 scale d, fp16 minimum m, 4-bit q low nibbles first, then high):
    Q4_0  [d | 16 bytes of q]          w = d * (q - 8)
    Q4_1  [d | m | 16 bytes of q]      w = d * q + m
    Q8_0  [d | 32 int8 q]              w = q * d
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

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


def dequantize(data: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """float32 values of `data` (rows of raw blocks, as gguf gives them)."""
    kernel = _TORCH_KERNELS.get(qtype)
    if kernel is None:
        return gguf.quants.dequantize(data, qtype)
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(-1, type_size)
    return kernel(blocks).reshape(*data.shape[:-1], -1).numpy()

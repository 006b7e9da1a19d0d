"""bf16 matmul inputs over storage for their rows rounded up to ROW_QUANTUM.

oneDNN makes (JIT-compiles) a primitive for each row count a matmul sees and keeps the last
1,024. A step paid 7-12 ms for a row count it had not seen, and the cache grew toward a
gigabyte (docs/benchmarks.md, "oneDNN makes a primitive for each new row count"). The
kernels that make a bf16 step's matmul inputs (the norms, silu_and_mul, the attention)
allocate their rows rounded up (kernels/padded_rows.h, kRowQuantum), the spare rows zeroed,
and `Linear` runs its matmuls over them: a few dozen row counts per shape.
"""

from __future__ import annotations

import torch

ROW_QUANTUM = 16


def rounded(rows: int) -> int:
    return -(-rows // ROW_QUANTUM) * ROW_QUANTUM


def padded_rows(x: torch.Tensor) -> torch.Tensor:
    """bf16 x [rows, cols] seen over its rows rounded up to ROW_QUANTUM where its storage
    holds them (made by `empty_padded_rows` or the kernels' own), else x itself (float32
    steps keep their exact row counts)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        return x
    rows, cols = x.shape
    padded = rounded(rows)
    if padded == rows or x.storage_offset() != 0 or not x.is_contiguous():
        return x
    if x.untyped_storage().nbytes() < padded * cols * x.element_size():
        return x
    return x.as_strided((padded, cols), (cols, 1))


def empty_padded_rows(rows: int, *rest: int, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty((rows, *rest)) over storage for rows rounded up to ROW_QUANTUM, the spare
    rows zeroed (as the kernels' padded_rows.h)."""
    full = torch.empty((rounded(rows), *rest), dtype=dtype)
    full[rows:].zero_()
    return full[:rows]


class PrimitiveWarmer:
    """While the engine is idle, each distinct bf16 matmul of the model (packed weight
    shape, bias, row split) runs once at every rounded row count a step can have, one
    row count a `step()`: a fresh server's first step of each size then finds oneDNN's
    primitive made (it cost 7-12 ms). `done` once every row count has run."""

    def __init__(self, model, max_rows: int) -> None:
        distinct: dict[tuple, object] = {}
        for module in model.modules() if model is not None else ():
            if getattr(module, "bf16_prefill", False) and module.packed is not None:
                key = (tuple(module.weight.shape), module.bias is None)
                distinct.setdefault(key, module)
        self.linears = list(distinct.values())
        self._rows = (
            list(range(ROW_QUANTUM, rounded(max_rows) + 1, ROW_QUANTUM)) if self.linears else []
        )

    @property
    def done(self) -> bool:
        return not self._rows

    def step(self) -> None:
        rows = self._rows.pop(0)
        with torch.inference_mode():
            for linear in self.linears:
                linear(torch.zeros(rows, linear.weight.shape[1], dtype=torch.bfloat16))

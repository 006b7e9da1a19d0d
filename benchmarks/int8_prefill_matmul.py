"""SmolLM2's four prefill matmuls, 30 layers' distinct weights (as a step streams them):
oneDNN's bf16 on the packed weights ember uses against torch._int_mm on int8 (what a
W8A8 prefill would run, before its quantize and rescale passes), ms per 30 layers.

    python benchmarks/int8_prefill_matmul.py
"""

from __future__ import annotations

import time

import torch

LAYERS = 30
SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def timed(fn, repeats: int = 5) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    torch.manual_seed(0)
    reorder = torch.ops.mkldnn._reorder_linear_weight
    bf16 = {
        k: [reorder(torch.randn(n, kk).bfloat16(), 16) for _ in range(LAYERS)]
        for k, (kk, n) in SHAPES.items()
    }
    int8 = {
        k: [torch.randint(-127, 127, (n, kk), dtype=torch.int8).t() for _ in range(LAYERS)]
        for k, (kk, n) in SHAPES.items()
    }
    linear = torch.ops.mkldnn._linear_pointwise
    for rows in (32, 64, 128, 256, 512):
        line = []
        totals = [0.0, 0.0]
        for name, (k, _) in SHAPES.items():
            x = torch.randn(rows, k).bfloat16()
            xi = torch.randint(-127, 127, (rows, k), dtype=torch.int8)
            a = timed(
                lambda x=x, name=name: [linear(x, w, None, "none", [], "") for w in bf16[name]]
            )
            b = timed(lambda xi=xi, name=name: [torch._int_mm(xi, w) for w in int8[name]])
            totals[0] += a
            totals[1] += b
            line.append(f"{name} {a:.2f} / {b:.2f}")
        print(f"{rows} rows: " + ", ".join(line) + f"; all {totals[0]:.1f} / {totals[1]:.1f} ms")


if __name__ == "__main__":
    main()

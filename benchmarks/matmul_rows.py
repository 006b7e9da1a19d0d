"""A step's matmuls at few rows: where bf16 on oneDNN stops paying and the GGUF blocks do.

    python benchmarks/matmul_rows.py

Loads the default model (bf16 prefill where the CPU has AMX or AVX512-BF16) and times,
per row count, every decoder layer's four matmuls (qkv, o, gate_up, down) as a step
runs them:
- "bf16 model": the packed bf16 copies of all layers, distinct weights streaming from
  memory as in a real step;
- "bf16 hot": the first layer's copies 30 times over (the weights stay in cache, as in a
  benchmark of one matmul);
- "int8 tiles": the int8 GEMM on the file's blocks (int8 activations), which decode
  steps of up to 16 rows take.
Milliseconds per pass over the layers (the best of two rounds of 5). Then, per matmul of
the first layer and row count, oneDNN's packed matmul whole against `linear_split_rows`
on two row ranges at once (a thread each): where oneDNN runs a shape on one thread, the
split wins (ms, the median of 200 calls after one).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from ember import LLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_attention import timed  # noqa: E402  (the median of calls after one, in ms)


def best_ms(fn, rounds: int = 2, repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        times.append((time.perf_counter() - start) / repeats * 1e3)
    return min(times)


def main() -> None:
    llm = LLM(None, kv_cache_memory=1 << 28)
    layers = llm.engine.core.runner.model.model.layers

    def linears(layer):
        attn, mlp = layer.self_attn, layer.mlp
        return [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]

    model = [linears(layer) for layer in layers]
    first = [linears(layers[0])] * len(layers)
    if not all(lin.bf16_prefill for lin in model[0]):
        raise SystemExit("this CPU runs no bf16 prefill (no AMX or AVX512-BF16)")
    tiles = all(lin.int8_gemm is not None and lin.blocks is not None for lin in model[0])
    print(f"{len(layers)} layers; int8 tiles: {'yes' if tiles else 'no'}")
    for rows in (16, 24, 32, 48, 64, 96, 128, 256, 512):
        xs = [torch.randn(rows, lin.weight.shape[1]) for lin in model[0]]
        cells = [
            f"bf16 model {best_ms(lambda xs=xs: bf16_pass(model, xs)):.1f}",
            f"bf16 hot {best_ms(lambda xs=xs: bf16_pass(first, xs)):.1f}",
        ]
        if tiles:
            cells.append(f"int8 tiles {best_ms(lambda xs=xs: int8_pass(model, xs)):.1f}")
        print(f"{rows} rows: " + ", ".join(cells) + " ms")
    split_table(model[0])


def split_table(lins) -> None:
    from ember.engine.kernels import cpu_kernels

    kernels = cpu_kernels()
    for name, lin in zip(("qkv", "o", "gate_up", "down"), lins, strict=True):
        cells = []
        for rows in (128, 192, 224, 256, 288, 320, 352, 384, 448, 512):
            x = torch.randn(rows, lin.weight.shape[1]).bfloat16()
            whole = timed(lambda x=x, lin=lin: lin_whole(lin, x), 200)
            split = timed(
                lambda x=x, lin=lin: kernels.linear_split_rows(x, lin.packed, None, 2), 200
            )
            cells.append(f"{rows}: {whole:.3f} / {split:.3f}")
        print(f"{name} whole / split: " + ", ".join(cells))


def lin_whole(lin, x):
    return torch.ops.mkldnn._linear_pointwise(x, lin.packed, None, "none", [], "")


def bf16_pass(stack, xs) -> None:
    lows = [x.bfloat16() for x in xs]
    for lins in stack:
        for lin, low in zip(lins, lows, strict=True):
            lin._packed_linear(low)


def int8_pass(stack, xs) -> None:
    for lins in stack:
        for lin, x in zip(lins, xs, strict=True):
            lin.int8_gemm(x, lin.blocks, lin.bias)


if __name__ == "__main__":
    main()

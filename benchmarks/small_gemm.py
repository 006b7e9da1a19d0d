"""Decode matmuls alone: one pass of ember's small GEMMs over a model's matmul weights.

A decode step reads every weight once; this times just that read-and-multiply, for the
shapes of SmolLM2-135M (30 layers of qkv, o, gate_up, down, then the tied lm_head), with
random weights held three ways: fp32 and bf16 (the small GEMM), and GGUF blocks laid out
as in SmolLM2's default file, Q4_1 layers and a Q8_0 head (the block GEMM; they decode to
fp32 weights), at 1-16 rows. Passes alternate between the three so a noisy box slows all
alike; the median of `--repeats` passes is printed with the bytes read per second.

    python benchmarks/small_gemm.py [--rows 1,2,4,8,16] [--repeats 7] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember.engine.kernels import cpu_kernels

SMOLLM2_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("ember's CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    weights = {
        str(dtype).removeprefix("torch."): [
            torch.randn(*shape).to(dtype) for shape in SMOLLM2_SHAPES
        ]
        for dtype in (torch.float32, torch.bfloat16)
    }
    weights["gguf blocks"] = [random_blocks(*shape) for shape in SMOLLM2_SHAPES]
    print("rows  weights      ms/pass   GB/s")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        times: dict[str, list[float]] = {name: [] for name in weights}
        for _ in range(args.repeats + 1):  # the first pass warms up
            for name, ws in weights.items():
                start = time.perf_counter()
                for (_, in_features), w in zip(SMOLLM2_SHAPES, ws, strict=True):
                    if w.dtype == torch.uint8:
                        kernels.block_gemm(xs[in_features], w, None)
                    else:
                        small_gemm(kernels, xs[in_features], w)
                times[name].append(time.perf_counter() - start)
        for name, ws in weights.items():
            seconds = statistics.median(times[name][1:])
            size = sum(w.numel() * w.element_size() for w in ws)
            print(f"{rows:4d}  {name:11s} {seconds * 1e3:8.1f} {size / seconds / 1e9:6.1f}")


def random_blocks(out_features: int, in_features: int) -> torch.Tensor:
    """Random bytes in Q4_1 blocks (Q8_0 for the head, as in SmolLM2's file), sane scales."""
    block_bytes = 34 if out_features == 49152 else 20
    blocks = torch.randint(
        0, 256, (out_features * in_features // 32, block_bytes), dtype=torch.uint8
    )
    for field in range(2 if block_bytes == 20 else 1):
        scales = (torch.rand(blocks.shape[0]) * 0.01).half()
        blocks[:, 2 * field : 2 * field + 2] = scales.view(torch.uint8).view(-1, 2)
    return blocks.view(out_features, -1, block_bytes)


def small_gemm(kernels, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The small GEMM takes up to 8 rows: more go through it in groups of 8."""
    return torch.cat([kernels.small_gemm(part.contiguous(), w, None) for part in x.split(8)])


if __name__ == "__main__":
    main()

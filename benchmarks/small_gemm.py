"""Decode matmuls alone: one pass of ember's small GEMM over a model's matmul weights.

A decode step reads every weight once; this times just that read-and-multiply, for the
shapes of SmolLM2-135M (30 layers of qkv, o, gate_up, down, then the tied lm_head), in
fp32 and in bf16 weights, at 1-8 rows, with random weights. Passes alternate with the
other dtype so a noisy box slows both alike; the median of `--repeats` passes is printed
with the bytes read per second.

    python benchmarks/small_gemm.py [--rows 1,2,4,8] [--repeats 7] [--threads 2]
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
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("ember's CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    weights = {
        dtype: [torch.randn(*shape).to(dtype) for shape in SMOLLM2_SHAPES]
        for dtype in (torch.float32, torch.bfloat16)
    }
    print("rows  dtype      ms/pass   GB/s")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in (576, 1536)}
        times: dict[torch.dtype, list[float]] = {dtype: [] for dtype in weights}
        for _ in range(args.repeats + 1):  # the first pass warms up
            for dtype, ws in weights.items():
                start = time.perf_counter()
                for w in ws:
                    kernels.small_gemm(xs[w.shape[1]], w, None)
                times[dtype].append(time.perf_counter() - start)
        for dtype, ws in weights.items():
            seconds = statistics.median(times[dtype][1:])
            size = sum(w.numel() * w.element_size() for w in ws)
            name = str(dtype).removeprefix("torch.")
            print(f"{rows:4d}  {name:9s} {seconds * 1e3:8.1f} {size / seconds / 1e9:6.1f}")


if __name__ == "__main__":
    main()

"""oneDNN's bf16 matmul whole against `linear_split_rows`, by thread count: where the
row split that pays on two cores stops paying on a machine with more.

    python benchmarks/split_threads.py [--threads 2,4,8,16] [--rows 128,256,512,1024,2048]

SmolLM2's four matmul shapes with random bf16 weights packed as ember packs them (no
model file needed). For each thread count (torch.set_num_threads) and row count: the
whole call, then the split into 2, 4, ... row ranges (a thread each, each range
single-threaded inside), ms, the median of 50 calls after one. "policy" marks the
split ember's rule picks at that thread count (parts = min(threads, rows //
SPLIT_MIN_PART_ROWS), on shapes where split_apply holds; "whole" where it runs whole).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prefill_attention import timed  # noqa: E402  (the median of calls after one, in ms)

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def main() -> None:
    from ember.engine.kernels import cpu_kernels
    from ember.models import layers

    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default=None, help="comma-separated (default 2 up to all)")
    parser.add_argument("--rows", default="128,256,512,1024,2048")
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    cores = os.cpu_count() or 2
    counts = [int(t) for t in args.threads.split(",")] if args.threads else []
    counts = counts or sorted({t for t in (2, 4, 8, 16, 32, cores) if t <= cores})
    kernels = cpu_kernels()
    print(
        f"{cores} CPUs; AMX: {layers.cpu_has_amx()}; split_apply: "
        + ", ".join(f"{n} {layers.split_apply(*SHAPES[n])}" for n in SHAPES)
    )
    packed = {
        name: torch.ops.mkldnn._reorder_linear_weight(torch.randn(out, inp).bfloat16(), 16)
        for name, (out, inp) in SHAPES.items()
    }
    for threads in counts:
        torch.set_num_threads(threads)
        for name, (out, inp) in SHAPES.items():
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, inp).bfloat16()
                w = packed[name]
                cells = [f"whole {timed(lambda x=x, w=w: whole(x, w), args.calls):.3f}"]
                parts = 2
                while parts <= threads and rows // parts >= 16:
                    ms = timed(
                        lambda x=x, w=w, p=parts: kernels.linear_split_rows(x, w, None, p),
                        args.calls,
                    )
                    cells.append(f"{parts} {ms:.3f}")
                    parts *= 2
                rule = min(threads, rows // layers.SPLIT_MIN_PART_ROWS)
                picked = rule if layers.split_apply(out, inp) and rule > 1 else "whole"
                print(
                    f"{threads} threads {name} {rows} rows: "
                    + ", ".join(cells)
                    + f" (policy: {picked})",
                    flush=True,
                )


def whole(x, w):
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


if __name__ == "__main__":
    main()

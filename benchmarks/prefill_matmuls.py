"""A prefill step's matmuls three ways, on SmolLM2's shapes: oneDNN on a packed fp32 copy,
oneDNN on a packed bf16 copy (x in bf16), and the int8 tiles' GEMM on Q4_1 blocks
(`tile_blocks`; x rounded to int8 per 32 values inside the call), as `matmul_precision`
ieee, bf16 and int8 run them. What `auto` picks on a CPU comes from this comparison.

`--copies` distinct weights per shape are multiplied in turn (as a step's layers do),
the three kinds alternating, `--repeats` rounds; the best time per call is printed with
its GFLOP/s.

    python benchmarks/prefill_matmuls.py [--rows 16,64,128,512] [--isa avx2] [--copies 10]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ember.engine.kernels import cpu_kernels
from ember.models.tiles import tile_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kquant_gemm import random_blocks  # noqa: E402  (random codes, small fp16 scales)

SHAPES = [(3072, 576), (576, 1536), (960, 576), (576, 576)]  # gate_up, down, qkv, o


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16,64,128,512")
    parser.add_argument("--copies", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default=None, help="a kernel build (default: the CPU's best)")
    args = parser.parse_args()
    kernels = cpu_kernels(args.isa)
    if kernels is None:
        raise SystemExit("ember's CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    print(
        f"{kernels.isa} build (tiles on VNNI: {kernels.tiles_use_vnni()}), {args.threads} threads"
    )
    print("out x in      rows   fp32 ms (GF/s)   bf16 ms (GF/s)   int8 tiles ms (GF/s)")
    for out_features, in_features in SHAPES:
        tiles = [
            tile_blocks(random_blocks("Q4_1", out_features, in_features))
            for _ in range(args.copies)
        ]
        weights = [torch.randn(out_features, in_features) for _ in range(args.copies)]
        fp32 = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in weights]
        bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16) for w in weights]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features)
            low = x.bfloat16()
            kinds = {
                "fp32": lambda i, x=x, w=fp32: torch.ops.mkldnn._linear_pointwise(
                    x, w[i], None, "none", [], ""
                ),
                "bf16": lambda i, x=low, w=bf16: torch.ops.mkldnn._linear_pointwise(
                    x, w[i], None, "none", [], ""
                ),
                "int8": lambda i, x=x, w=tiles: kernels.block_gemm_int8(x, w[i], None),
            }
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(args.repeats):
                for name, call in kinds.items():
                    for i in range(args.copies):
                        call(i)
                    start = time.perf_counter()
                    for i in range(args.copies):
                        call(i)
                    best[name] = min(best[name], (time.perf_counter() - start) / args.copies)
            flop = 2 * rows * out_features * in_features
            cells = [f"{best[k] * 1e3:7.3f} ({flop / best[k] / 1e9:4.0f})" for k in kinds]
            print(f"{out_features:4} x {in_features:4} {rows:5}   " + "   ".join(cells))


if __name__ == "__main__":
    main()

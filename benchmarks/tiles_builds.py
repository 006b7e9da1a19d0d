"""The int8 tiles' GEMM on each kernel build in one process: the AVX-512 build (on
AVX512-VNNI where the CPU has it), the AVX2 build on AVX-VNNI (where the CPU has it) and
on maddubs + madd, and the generic build (plain 16-byte vectors). The kinds alternate call by call over `--copies` weights per shape (as
a decode step's layers read them), `--repeats` rounds; the best µs a call is printed.

    python benchmarks/tiles_builds.py [--rows 1,4,8,16,64] [--copies 30] [--repeats 7]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ember.engine.kernels import cpu_kernels, supported_isas
from ember.models.tiles import tile_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kquant_gemm import random_blocks  # noqa: E402  (random codes, small fp16 scales)

CASES = [("Q4_1", 3072, 576), ("Q4_1", 576, 1536), ("Q8_0", 3072, 576)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,64")
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kinds = {}
    for isa in ("avx512", "avx2", "generic"):
        kernels = cpu_kernels(isa) if isa in supported_isas() else None
        if kernels is None:
            continue
        if kernels.tiles_use_vnni():
            kinds[f"{isa} {kernels.tiles_vnni_name()}"] = (kernels, True)
        kinds[f"{isa} maddubs" if isa != "generic" else isa] = (kernels, False)
    if not kinds:
        raise SystemExit("no kernel build runs here")
    print(f"{args.threads} threads, {args.copies} copies of W; µs a call, best of {args.repeats}")
    for name, out_features, in_features in CASES:
        tiles = [
            tile_blocks(random_blocks(name, out_features, in_features)) for _ in range(args.copies)
        ]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features)
            best = dict.fromkeys(kinds, float("inf"))
            for _ in range(args.repeats):
                for kind, (kernels, vnni) in kinds.items():
                    for w in tiles:  # warm
                        kernels.tiled_gemm_int8(x, w, None, allow_vnni=vnni)
                    start = time.perf_counter()
                    for w in tiles:
                        kernels.tiled_gemm_int8(x, w, None, allow_vnni=vnni)
                    took = (time.perf_counter() - start) / len(tiles)
                    best[kind] = min(best[kind], took)
            cells = "  ".join(f"{kind} {us * 1e6:7.1f}" for kind, us in best.items())
            print(f"{name} {out_features}x{in_features} rows {rows:3}: {cells}")


if __name__ == "__main__":
    main()

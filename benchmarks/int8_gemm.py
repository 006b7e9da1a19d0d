"""The block GEMM with int8 activations against the exact one (fp32 activations), on the
same GGUF blocks: SmolLM2's shapes, random codes with small fp16 scales, 1 to 8 rows.
Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 blocks also in tiles of 16 features (`tile_blocks`: int8_tiles.cpp),
and where the tiles' sums use VNNI (AVX512-VNNI, or AVX-VNNI in the AVX2 build) also
without it (maddubs + madd: "no VNNI").

The two alternate call by call, `--repeats` rounds; the minimum per call is printed with
the bytes of W read per second. With several copies of W (`--copies`, 30 by default: one
per layer, as a decode step reads them) the weights do not stay in cache.

    python benchmarks/int8_gemm.py [--formats Q4_1,Q8_0] [--shapes 3072x576,49152x576]
        [--rows 1,2,4,8] [--threads 2] [--isa avx512]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import gguf
import torch

from ember.engine.kernels import cpu_kernels
from ember.models.tiles import TILE_FORMATS, tile_blocks

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kquant_gemm import random_blocks  # noqa: E402  (random codes, small fp16 scales)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="Q4_1,Q8_0")
    parser.add_argument("--shapes", default="3072x576,576x1536", help="out x in features")
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--copies", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--isa", default=None, help="a kernel build (default: the CPU's best)")
    args = parser.parse_args()
    kernels = cpu_kernels(args.isa)
    if kernels is None:
        raise SystemExit("ember's CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    vnni = kernels.tiles_vnni_name()
    print(f"{kernels.isa} build (tiles on VNNI: {vnni or 'none'}), {args.threads} threads,"
          f" {args.copies} copies of W")  # fmt: skip
    print("format shape        rows   fp32 us  int8 us  tiles us  fp32 GB/s  int8 GB/s"
          "  tiles GB/s  int8 / tiles speed-up" + ("  no VNNI us" if vnni else ""))  # fmt: skip
    for name in args.formats.split(","):
        for shape in args.shapes.split(","):
            out_features, in_features = map(int, shape.split("x"))
            weights = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][0]
            if in_features % weights:
                continue  # K-quants: whole 256-weight super-blocks only
            copies = [random_blocks(name, out_features, in_features) for _ in range(args.copies)]
            tiled = [tile_blocks(w) for w in copies] if copies[0].shape[2] in TILE_FORMATS else []
            nbytes = copies[0].numel()
            for rows in map(int, args.rows.split(",")):
                x = torch.randn(rows, in_features)
                kinds = [
                    ("fp32", kernels.block_gemm, copies),
                    ("int8", kernels.block_gemm_int8, copies),
                ]
                if tiled:
                    kinds.append(("tiles", kernels.block_gemm_int8, tiled))
                if tiled and vnni:
                    kinds.append(("no VNNI", _without_vnni(kernels), tiled))
                best = dict.fromkeys(["fp32", "int8", "tiles", "no VNNI"], float("nan"))
                for _ in range(args.repeats):
                    for kind, gemm, weights in kinds:
                        for w in weights:
                            gemm(x, w, None)
                        start = time.perf_counter()
                        for w in weights:
                            gemm(x, w, None)
                        took = (time.perf_counter() - start) / len(weights)
                        best[kind] = took if best[kind] != best[kind] else min(best[kind], took)
                fp32, int8, tiles = best["fp32"], best["int8"], best["tiles"]
                print(f"{name:6} {shape:12} {rows:4} {fp32 * 1e6:9.1f} {int8 * 1e6:8.1f}"
                      f" {tiles * 1e6:9.1f} {nbytes / fp32 / 1e9:10.1f} {nbytes / int8 / 1e9:10.1f}"
                      f" {nbytes / tiles / 1e9:11.1f} {fp32 / int8:6.2f} {fp32 / tiles:6.2f}"
                      + (f" {best['no VNNI'] * 1e6:11.1f}" if vnni else ""))  # fmt: skip


def _without_vnni(kernels):
    def gemm(x, tiles, bias):
        return kernels.tiled_gemm_int8(x, tiles, bias, allow_vnni=False)

    return gemm


if __name__ == "__main__":
    main()

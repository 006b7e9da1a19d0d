"""The int8 tiles' GEMM on SmolLM2's four shapes at a prefill's and a decode's row counts,
one line per run, for comparing two trees' kernels run after run (each tree's own build;
its directory first on PYTHONPATH):

    for r in 1 2 3 4 5 6; do for tree in BEFORE AFTER; do
      echo "$tree $(PYTHONPATH=$tree .venv/bin/python benchmarks/tiles_rows.py)"; done; done

Six Q4_1 weights per shape are multiplied in turn (as a step's layers do), best of 7, in
ms a call: `OUTxIN@ROWS:MS`.
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
from prefill_matmuls import SHAPES  # noqa: E402  (gate_up, down, qkv, o)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="760,16")
    parser.add_argument("--copies", type=int, default=6)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        sys.exit("no ember CPU kernels on this machine")
    torch.manual_seed(0)
    out = []
    for n, k in SHAPES:
        blocks = random_blocks("Q4_1", n, k).view(n, k // 32, 20)
        weights = [tile_blocks(blocks, kernels) for _ in range(args.copies)]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k)
            best = float("inf")
            for _ in range(args.repeats):
                start = time.perf_counter()
                for w in weights:
                    kernels.tiled_gemm_int8(x, w, None, True)
                best = min(best, (time.perf_counter() - start) / len(weights))
            out.append(f"{n}x{k}@{rows}:{best * 1e3:.3f}")
    print(" ".join(out))


if __name__ == "__main__":
    main()

"""What a new row count costs a bf16 matmul on oneDNN, which makes (JIT-compiles) a primitive
for each input shape and keeps the last ONEDNN_PRIMITIVE_CACHE_CAPACITY of them (1,024 by
default): SmolLM2's four matmul shapes, random bf16 weights packed as ember packs them.

    python benchmarks/onednn_rows.py                 # first and second call, a few row counts
    python benchmarks/onednn_rows.py --sweep 16 560  # every row count, twice: time and memory

Run it with ONEDNN_PRIMITIVE_CACHE_CAPACITY set to see a larger cache (read once, when
oneDNN first runs).
"""

from __future__ import annotations

import argparse
import os
import time

import torch

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down (N, K)


def resident_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="17,64,300,301")
    p.add_argument("--sweep", nargs=2, type=int, metavar=("FIRST", "LAST"))
    args = p.parse_args()
    torch.manual_seed(0)
    packed = [
        torch.ops.mkldnn._reorder_linear_weight(torch.randn(n, k).to(torch.bfloat16), 16)
        for n, k in SHAPES
    ]
    most = max([int(r) for r in args.rows.split(",")] + list(args.sweep or [0]))
    inputs = {k: torch.zeros(most, k, dtype=torch.bfloat16) for _, k in SHAPES}

    def call(rows: int, shape: int) -> float:
        start = time.perf_counter()
        x = inputs[SHAPES[shape][1]][:rows]
        torch.ops.mkldnn._linear_pointwise(x, packed[shape], None, "none", [], "")
        return (time.perf_counter() - start) * 1e3

    capacity = os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "default (1024)")
    print(f"threads {torch.get_num_threads()}, primitive cache capacity {capacity}")
    if args.sweep is None:
        for shape, (n, k) in enumerate(SHAPES):
            for rows in (int(r) for r in args.rows.split(",")):
                first, second = call(rows, shape), call(rows, shape)
                print(f"{k} -> {n}, {rows} rows: first {first:.3f} ms, second {second:.3f} ms")
        return
    before = resident_mb()
    for sweep in range(2):
        start = time.perf_counter()
        for rows in range(args.sweep[0], args.sweep[1] + 1):
            for shape in range(len(SHAPES)):
                call(rows, shape)
        seconds = time.perf_counter() - start
        print(f"sweep {sweep + 1}: {seconds:.2f} s, resident +{resident_mb() - before:.0f} MB")


if __name__ == "__main__":
    main()

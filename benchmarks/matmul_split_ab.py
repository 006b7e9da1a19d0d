"""Prefill with the bf16 matmuls whole or split by rows as the engine chose them.

    EMBER_MATMUL_SPLIT=measure python benchmarks/matmul_split_ab.py   # (then =rule)

The default model in bf16 (benchmarks/mixed_steps.py's, with steps of up to 2,048 tokens),
its idle work done first (KV pages, the matmul timings of ember.engine.matmul_split unless
$EMBER_MATMUL_SPLIT=rule, calibration, oneDNN's primitives); then prompts of each
`--lengths` alone, one new token, medians of `--repeats` (ms); and with `--per-call N`,
each packed matmul's time a call over that many further N-token prefills, by shape, with
the ranges it ran in (1: whole). `--force split|whole` overrides the tables measured.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

from ember import SamplingParams, envs
from ember.engine.padded_rows import padded_rows
from ember.models.layers import Linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mixed_steps import settled_llm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="512,896,1024,1536,2048")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--per-call", type=int, default=0)
    p.add_argument("--force", choices=["split", "whole"], default=None)
    args = p.parse_args()
    llm, prompt = settled_llm(max_num_batched_tokens=2048)
    if args.force:
        for m in llm.engine.core.runner.model.modules():
            if isinstance(m, Linear) and m.split_by_rows is not None:
                m.split_by_rows = (args.force == "split",) * len(m.split_by_rows)
    one = SamplingParams(max_tokens=1, temperature=0)
    cells = []
    for n in map(int, args.lengths.split(",")):
        times = []
        for _ in range(args.repeats):
            p_ = prompt(n)
            start = time.perf_counter()
            llm.generate([p_], one)
            times.append(time.perf_counter() - start)
        cells.append(f"{n}: {statistics.median(times) * 1e3:.0f}")
    print(f"EMBER_MATMUL_SPLIT={envs.matmul_split()} force={args.force}: " + ", ".join(cells))
    if args.per_call:
        per_call(llm, prompt, one, args.per_call, args.repeats)


def per_call(llm, prompt, params, rows: int, repeats: int) -> None:
    """Each packed matmul's time a call, by (shape, rows, ranges), over `repeats` prefills."""
    packed = Linear._packed_linear
    seconds = collections.defaultdict(lambda: [0.0, 0])

    def timed(self, x):
        start = time.perf_counter()
        y = packed(self, x)
        cell = seconds[(tuple(self.weight.shape), len(x), self.split_parts(len(padded_rows(x))))]
        cell[0] += time.perf_counter() - start
        cell[1] += 1
        return y

    Linear._packed_linear = timed
    try:
        for _ in range(repeats):
            llm.generate([prompt(rows)], params)
    finally:
        Linear._packed_linear = packed
    for (shape, n, parts), (total, calls) in sorted(seconds.items()):
        print(
            f"  {shape[0]} x {shape[1]}, {n} rows, {parts} range(s): {total / calls * 1e3:.3f} ms"
        )


if __name__ == "__main__":
    main()

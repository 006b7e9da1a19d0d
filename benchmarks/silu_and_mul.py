"""bf16 silu_and_mul as a bf16 prefill step runs it: 30 layers' distinct gate_up outputs of
SmolLM2's width (ROWS x 3,072), the median of 20 passes over them, ms.

    python benchmarks/silu_and_mul.py [--rows 519]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ember.engine.kernels import cpu_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=519)
    args = p.parse_args()
    kernels = cpu_kernels()
    inputs = [torch.randn(args.rows, 3072).bfloat16() for _ in range(30)]

    def one_pass() -> float:
        start = time.perf_counter()
        for gate_up in inputs:
            kernels.silu_and_mul(gate_up)
        return (time.perf_counter() - start) * 1e3

    one_pass()
    ms = statistics.median(one_pass() for _ in range(20))
    print(f"30 layers of {args.rows} x 3072: {ms:.2f} ms ({torch.get_num_threads()} threads)")


if __name__ == "__main__":
    main()

"""Decode steps over a float32 and a bf16 KV cache, alternating, in one process: for each
context length, SEQS sequences of random tokens are prefilled (untimed), then decode
NEW tokens together; prints ms per decode step and the pool's blocks for each dtype.

    python benchmarks/kv_dtype.py [--contexts 300,1500,3000] [--seqs 4] [--rounds 3]
"""

from __future__ import annotations

import argparse
import random
import time

from ember.llm import LLM
from ember.sampling_params import SamplingParams


def decode_ms(llm: LLM, prompts: list[list[int]], new: int) -> float:
    llm.generate(prompts, SamplingParams(max_tokens=1, ignore_eos=True))  # prefill, cached
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=new + 1, ignore_eos=True, temperature=0))
    return (time.perf_counter() - start) / new * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="300,1500,3000")
    p.add_argument("--seqs", type=int, default=4)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--precision", default="bf16", choices=["ieee", "bf16"])
    args = p.parse_args()
    dtypes = ("float32", "bfloat16")
    engines = {
        d: LLM(
            None,
            matmul_precision=args.precision,
            kv_cache_memory=1 << 30,
            max_model_len=4096,
            kv_cache_dtype=d,
        )  # fmt: skip
        for d in dtypes
    }
    for d, llm in engines.items():
        while llm.engine.core.has_idle_work():  # the pool's pages, as an idle server takes them
            llm.engine.core.idle_work()
        print(f"{d}: {llm.engine.core.scheduler.kv_cache.num_blocks} blocks in 1 GiB")
    rng = random.Random(0)
    for context in map(int, args.contexts.split(",")):
        times = {d: [] for d in dtypes}
        for r in range(args.rounds):
            prompts = [
                [rng.randrange(100, 40000) for _ in range(context)] for _ in range(args.seqs)
            ]
            for d in dtypes if r % 2 == 0 else dtypes[::-1]:
                times[d].append(decode_ms(engines[d], prompts, args.new))
        line = ", ".join(f"{d} {' / '.join(f'{t:.2f}' for t in times[d])}" for d in dtypes)
        print(f"context {context}, {args.seqs} sequences: ms per decode step: {line}")


if __name__ == "__main__":
    main()

"""Decode steps at a long context, in process: N sequences with prompts of L random tokens,
64 tokens each, greedy; the median decode-only step's time (ms), twice (the second after
the first warmed everything). The default model in bf16 (`matmul_precision="bf16"`, a bf16
KV cache), its idle work done first (the KV pool's pages, calibration, primitives).

    python benchmarks/decode_context.py --seqs 6 --context 1500
    EMBER_HUGE_PAGES=0 python benchmarks/decode_context.py   # weights and pool on 4 KB pages
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from ember import LLM, SamplingParams
from ember.engine.core import EngineCore


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=6)
    p.add_argument("--context", type=int, default=1500)
    args = p.parse_args()
    llm = LLM(None, matmul_precision="bf16", kv_cache_memory=2 << 30, max_model_len=4096)
    core = llm.engine.core
    while core.has_idle_work():
        core.idle_work()
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 40000) for _ in range(args.context)] for _ in range(args.seqs)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    times: list[float] = []
    update = EngineCore._update

    def timed_update(self, done, step):
        outputs = update(self, done, step)
        if done.shape.num_prefill_tokens == 0:
            times.append((time.perf_counter() - done.start) * 1e3)
        return outputs

    EngineCore._update = timed_update
    for _ in range(2):
        times.clear()
        llm.generate(prompts, params)
    print(f"{args.seqs} x {args.context} tokens: decode step {statistics.median(times):.2f} ms "
          f"(median of {len(times)})")  # fmt: skip


if __name__ == "__main__":
    main()

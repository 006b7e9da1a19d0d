"""One long prompt alone over two pipeline stages: its time to first token with its
chunks overlapping in the stages (a chunk goes in while the one before is in the second
stage) against one step at a time (EMBER_PIPELINE_STEPS_IN_FLIGHT=1), and one process.

    python benchmarks/pipeline_prefill.py [--model smollm2-135m] [--tokens 2048]
        [--chunk 256] [--runs 5]

Each configuration runs in a fresh process (one thread per rank: the 2 stages on the 2
cores, the single process on one of them and on both); per run a distinct prompt of
`--tokens` tokens, greedy, one output token, after one warm-up run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time


def run_one(args: argparse.Namespace) -> list[float]:
    import torch

    from ember import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    llm = LLM(args.model, pipeline_parallel_size=args.pp, max_num_batched_tokens=args.chunk,
              max_model_len=args.tokens + 16, kv_cache_memory=512 << 20, max_step_ms=0)  # fmt: skip
    rng = random.Random(0)
    vocab = llm.engine.core.model_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0)
    times = []
    for _ in range(args.runs + 1):
        prompt = [rng.randrange(100, vocab) for _ in range(args.tokens)]
        start = time.perf_counter()
        llm.generate([prompt], params)
        times.append(time.perf_counter() - start)
    llm.close()
    return times[1:]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pp", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.pp:
        print(json.dumps(run_one(args)))
        return
    configs = [
        ("1 process, 1 thread", 1, 1, "2"),
        ("1 process, 2 threads", 1, 2, "2"),
        ("PP=2, one step at a time", 2, 1, "1"),
        ("PP=2, chunks overlapping", 2, 1, "2"),
    ]
    print(f"| {args.tokens} tokens, chunks of {args.chunk} | TTFT median s | min s | max s |")
    print("|---|---|---|---|")
    for name, pp, threads, in_flight in configs:
        command = [sys.executable, __file__, "--model", args.model, "--tokens", str(args.tokens),
                   "--chunk", str(args.chunk), "--runs", str(args.runs), "--pp", str(pp),
                   "--threads", str(threads)]  # fmt: skip
        env = dict(os.environ, EMBER_PIPELINE_STEPS_IN_FLIGHT=in_flight)
        result = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        times = json.loads(result.stdout.strip().splitlines()[-1])
        print(f"| {name} | {statistics.median(times):.3f} | {min(times):.3f} "
              f"| {max(times):.3f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

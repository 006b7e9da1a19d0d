"""One model over 1 or 2 processes (tensor parallel): decode step time, output tokens per
second, the share of rank 0's step spent in collectives, and each rank's peak RSS.

    python benchmarks/tensor_parallel.py [--model smollm2-135m] [--batch 1 4] [--tokens 64]

Each configuration runs in a fresh process (peak RSS of its own): TP=1 on one thread,
TP=1 on as many threads as TP=2 has cores, TP=2 with one core per rank. Per batch size:
`batch` prompts of ~40 tokens, greedy, `tokens` new tokens each (ignore_eos), after a
warm-up of the same shape; "step ms" is the engine's own mean step time (one prefill
step, then decode steps). "in collectives" is rank 0's time inside all-reduce / all-gather,
which includes waiting for the slower rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _peak_rss_mb(pid: int | str = "self") -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def run_one(args: argparse.Namespace) -> dict:
    import torch

    from ember import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    comm_s = [0.0]
    llm = LLM(args.model, tensor_parallel_size=args.tp, max_model_len=1024,
              kv_cache_memory=256 << 20, max_step_ms=0)  # fmt: skip
    runner = llm.engine.core.runner
    if args.tp > 1:
        comm = runner.group.comm
        for name in ("all_reduce", "all_gather"):
            call = getattr(comm, name)

            def timed(tensor, call=call):
                start = time.perf_counter()
                out = call(tensor)
                comm_s[0] += time.perf_counter() - start
                return out

            setattr(comm, name, timed)
    tokenizer = llm.get_tokenizer()
    text = "Write a short story about a lighthouse keeper who finds a message in a bottle."
    result = {"tp": args.tp, "threads": args.threads, "batches": {}}
    for batch in args.batch:
        prompts = [tokenizer.encode(f"{i}. {text}") for i in range(batch)]
        params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
        llm.generate(prompts, params)  # warm-up
        stats = llm.engine.stats()
        steps0, seconds0, comm0 = stats.num_steps, stats.step_seconds, comm_s[0]
        start = time.perf_counter()
        llm.generate(prompts, params)
        wall = time.perf_counter() - start
        stats = llm.engine.stats()
        steps = stats.num_steps - steps0
        step_s = stats.step_seconds - seconds0
        result["batches"][batch] = {
            "tok_s": batch * args.tokens / wall,
            "step_ms": 1e3 * step_s / steps,
            "comm_share": (comm_s[0] - comm0) / step_s,
        }
    ranks = [os.getpid()]
    if runner.executor is not None:
        ranks += [p.pid for p in runner.executor._processes]
    result["peak_rss_mb"] = [_peak_rss_mb(pid) for pid in ranks]
    result["weight_mb"] = [runner.weight_bytes() / 1e6] + [
        b / 1e6 for b in (runner.executor.rank_weight_bytes if runner.executor else [])
    ]
    llm.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--tp", type=int, default=None, help="(internal) one configuration")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    if args.tp is not None:
        print(json.dumps(run_one(args)))
        return
    cores = len(os.sched_getaffinity(0))
    configs = [(1, 1), (1, min(2, cores)), (2, 1)]
    print(f"model {args.model}, {args.tokens} new tokens, {cores} cores")
    print(f"{'config':<16} {'batch':>5} {'tok/s':>8} {'step ms':>8} {'in coll.':>8}  "
          "peak RSS MB per rank / weights MB")  # fmt: skip
    for tp, threads in configs:
        command = [sys.executable, __file__, "--model", args.model, "--tp", str(tp),
                   "--threads", str(threads), "--tokens", str(args.tokens),
                   "--batch", *map(str, args.batch)]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        result = json.loads(out.strip().splitlines()[-1])
        name = f"TP={tp} ({threads} thr{'/rank' if tp > 1 else ''})"
        for batch, row in result["batches"].items():
            rss = " ".join(f"{mb:.0f}" for mb in result["peak_rss_mb"])
            weights = " ".join(f"{mb:.0f}" for mb in result["weight_mb"])
            print(f"{name:<16} {batch:>5} {row['tok_s']:>8.1f} {row['step_ms']:>8.2f} "
                  f"{row['comm_share']:>8.0%}  {rss} / {weights}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()

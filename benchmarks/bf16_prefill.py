"""Prefill time by matmul precision: `python benchmarks/bf16_prefill.py [MODEL] --precision P`.

One engine per run (prefix caching off, so every prompt is computed), greedy, one new
token each: a 286- and a 512-token prompt alone, then 4 prompts of 286 tokens at once
(one 512-token step and a 632-token one); then, with `--decode-seqs N`, one decode step
of N sequences (16-token prompts; 33 new tokens each minus 1, over 32 steps). Medians of `--repeats` runs, after a warm-up,
of the wall time and of the process's CPU time (at `--threads 1` the CPU time is the work
itself, which other processes on a shared box barely change), and the process's resident
memory once the model is loaded. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ember import LLM, SamplingParams


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(1000, 40000) for _ in range(length)] for _ in range(num)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--precision", default="ieee")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    parser.add_argument("--decode-seqs", type=int, default=0, help="also time decode steps")
    parser.add_argument(
        "--kernel-attention",
        action="store_true",
        help="bf16 prefill chunks attend through ember's kernel also on AMX (no bf16 SDPA)",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(
        args.model,
        matmul_precision=args.precision,
        enable_prefix_caching=False,
        kv_cache_memory=1 << 30,
    )
    backends = {getattr(m, "backend", None) for m in llm.engine.core.runner.model.modules()} - {
        None
    }
    for backend in backends:
        if args.kernel_attention and hasattr(backend, "bf16_sdpa"):
            backend.bf16_sdpa = False
    result = dict(
        precision=args.precision, threads=torch.get_num_threads(), rss_mb=round(_rss_mb()),
        bf16_sdpa=any(getattr(b, "bf16_sdpa", False) for b in backends),
    )  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    cases = {"286": _prompts(1, 286, 1), "512": _prompts(1, 512, 2), "4x286": _prompts(4, 286, 3)}
    llm.generate(_prompts(2, 64, 0), params)  # warm-up
    for name, prompts in cases.items():
        walls, cpus = [], []
        for _ in range(args.repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            llm.generate(prompts, params)
            walls.append(time.perf_counter() - wall)
            cpus.append(time.process_time() - cpu)
        result[f"prefill_{name}_s"] = round(statistics.median(walls), 4)
        result[f"prefill_{name}_cpu_s"] = round(statistics.median(cpus), 4)
    if args.decode_seqs:
        result["decode_step_cpu_ms"] = _decode_step_ms(llm, args.decode_seqs, args.repeats)
    print(json.dumps(result))


def _decode_step_ms(llm, num_seqs: int, repeats: int) -> float:
    """CPU ms of one decode step of `num_seqs` sequences (median over `repeats`)."""
    prompts = _prompts(num_seqs, 16, 4)
    steps = []
    for _ in range(repeats):
        cpu = time.process_time()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
        prefill = time.process_time() - cpu
        cpu = time.process_time()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=33, ignore_eos=True))
        steps.append((time.process_time() - cpu - prefill) / 32)
    return round(statistics.median(steps) * 1e3, 1)


if __name__ == "__main__":
    main()

"""Prefill time in process, ember or vLLM: `python benchmarks/prefill_peer.py --side S`.

One engine (prefix caching off, so every prompt is computed), random token-id prompts,
one greedy new token each; after a warm-up, the median wall time of `--repeats` calls of
`LLM.generate` per case: one prompt of 512 and of 286 tokens, then 4 prompts of 286 and
of 190 tokens at once. Prints one line per case. Run each side with its own Python, in
turn (docs/benchmarks.md):

    .venv/bin/python benchmarks/prefill_peer.py --side ember
    /work/peers/vllm/bin/python benchmarks/prefill_peer.py --side vllm \\
        --model /work/bench/smollm2-hf

ember runs its defaults (bf16 prefill where the CPU has AMX or AVX512-BF16, steps of
--max-num-batched-tokens, default 512); vLLM runs in bf16 with
--max-num-batched-tokens (default 4096 here) and its CPU KV space of 2 GB on cores 0-1.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

CASES = [(1, 512), (1, 286), (4, 286), (4, 190)]


def make_generate(side: str, model: str | None, max_batched: int | None):
    """That side's engine, as a function of token-id prompts: one greedy token each."""
    if side == "ember":
        from ember import LLM, SamplingParams

        llm = LLM(
            model,
            enable_prefix_caching=False,
            kv_cache_memory=1 << 30,
            max_num_batched_tokens=max_batched or 512,
        )
        params = SamplingParams(temperature=0, max_tokens=1)
        return lambda prompts: llm.generate(prompts, params)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="bfloat16",
        max_model_len=4096,
        enable_prefix_caching=False,
        max_num_batched_tokens=max_batched or 4096,
    )
    params = SamplingParams(temperature=0, max_tokens=1)
    return lambda prompts: llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--side", choices=["ember", "vllm"], required=True)
    parser.add_argument("--model", default=None, help="ember: its default model if unset")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    if args.side == "vllm" and args.model is None:
        parser.error("--side vllm needs --model (a Hugging Face directory)")
    generate = make_generate(args.side, args.model, args.max_num_batched_tokens)
    rng = random.Random(0)

    def timed(num: int, length: int) -> float:
        prompts = [[rng.randint(1000, 40000) for _ in range(length)] for _ in range(num)]
        start = time.perf_counter()
        generate(prompts)
        return time.perf_counter() - start

    for _ in range(3):
        timed(1, 512)
    for num, length in CASES:
        ms = statistics.median(timed(num, length) for _ in range(args.repeats)) * 1e3
        print(f"{args.side} prefill {num} x {length}: median {ms:.1f} ms", flush=True)


if __name__ == "__main__":  # vLLM starts its engine in a spawned process
    main()

"""`ember bench offline`: engine speed without HTTP, and transformers on the same work.

Scenarios (all greedy, ignore_eos, prefix caching off so every prompt is computed):
- throughput: N prompts of ~P tokens, G new tokens each, all submitted at once;
- prefill: prompt tokens/s on the same prompts with one new token each;
- latency: one 286-token prompt: time to first token, then ms per decoded token;
- concurrent-4: 4 prompts of 286 tokens, 64 new tokens each (the issue's vLLM bar);
  the latency scenarios report the median of `--repeats` runs.
`--compare-hf` runs transformers' batched generate on the throughput workload too.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from ember.sampling_params import SamplingParams


def random_prompts(
    num: int, length: int, vocab: int, seed: int = 0, spread: float = 0.1
) -> list[list[int]]:
    """Token-id prompts of length ±spread, from the vocabulary's plain tokens."""
    rng = random.Random(seed)
    low, high = min(1000, vocab // 4), vocab - 1
    lengths = [
        rng.randint(int(length * (1 - spread)), int(length * (1 + spread))) for _ in range(num)
    ]
    return [[rng.randint(low, high) for _ in range(n)] for n in lengths]


def _timed(llm, prompts, max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return time.perf_counter() - start, outputs


def bench_ember(llm, args) -> dict:
    vocab = llm.engine.model_config.vocab_size
    results: dict = {}
    _timed(llm, random_prompts(2, 32, vocab, seed=99), 4)  # warm-up
    if not args.skip_throughput:
        prompts = random_prompts(args.num_prompts, args.prompt_len, vocab)
        num_prompt = sum(map(len, prompts))
        seconds, _ = _timed(llm, random_prompts(args.num_prompts, args.prompt_len, vocab, 1), 1)
        results["prefill_tokens_per_s"] = num_prompt / seconds
        seconds, outs = _timed(llm, prompts, args.output_len)
        num_out = sum(len(o.outputs[0].token_ids) for o in outs)
        results["throughput"] = dict(
            seconds=seconds,
            output_tokens_per_s=num_out / seconds,
            total_tokens_per_s=(num_out + num_prompt) / seconds,
        )
    prompt = random_prompts(1, 286, vocab, seed=2, spread=0)
    four = random_prompts(4, 286, vocab, seed=3, spread=0)
    runs = []
    for _ in range(args.repeats):  # medians: single runs on a small box vary by ~10%
        ttft, _ = _timed(llm, prompt, 1)
        total, _ = _timed(llm, prompt, 64)
        seconds, _ = _timed(llm, four, 64)
        runs.append((ttft, (total - ttft) / 63, seconds))
    ttft, per_token, seconds = (statistics.median(r[i] for r in runs) for i in range(3))
    results["latency"] = dict(
        prefill_286_s=ttft, decode_ms_per_token=per_token * 1e3, decode_tokens_per_s=1 / per_token
    )
    results["concurrent_4"] = dict(seconds=seconds, output_tokens_per_s=4 * 64 / seconds)
    return results


def bench_transformers(llm, args, batch_size: int = 16) -> dict:
    """transformers' generate on the throughput workload, in left-padded batches, on the
    engine's device (on CUDA in the engine's dtype; on CPU in fp32)."""
    from ember.loader.hf_reference import transformers_model

    runner = llm.engine.core.runner
    device = runner.device
    dtype = runner.dtype if device.type == "cuda" else torch.float32
    model = transformers_model(llm.engine.checkpoint, dtype).to(device)
    vocab = llm.engine.model_config.vocab_size
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab)
    start = time.perf_counter()
    num_out = 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=device)
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
        num_out += (out.shape[1] - width) * len(batch)
    seconds = time.perf_counter() - start  # generate returns token ids: synchronized
    return dict(seconds=seconds, output_tokens_per_s=num_out / seconds, batch_size=batch_size)


def run_offline(args: argparse.Namespace) -> int:
    from ember import LLM
    from ember.engine_args import engine_options

    if args.threads:
        torch.set_num_threads(args.threads)
    options = engine_options(args) | dict(enable_prefix_caching=False)
    llm = LLM(args.model, **options)
    results = dict(model=args.model or "smollm2-135m", threads=torch.get_num_threads())
    results["ember"] = bench_ember(llm, args)
    if args.compare_hf:
        results["transformers"] = bench_transformers(llm, args)
    print(format_table(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def format_table(results: dict) -> str:
    ember = results["ember"]
    rows = []
    if "throughput" in ember:
        rows.append(("output tokens/s (throughput)", ember["throughput"]["output_tokens_per_s"]))
        rows.append(("prompt tokens/s (prefill)", ember["prefill_tokens_per_s"]))
    rows.append(("prefill 286 tokens (s)", ember["latency"]["prefill_286_s"]))
    rows.append(("batch-1 decode (ms/token)", ember["latency"]["decode_ms_per_token"]))
    rows.append(("batch-1 decode (tokens/s)", ember["latency"]["decode_tokens_per_s"]))
    rows.append(("4 concurrent, output tokens/s", ember["concurrent_4"]["output_tokens_per_s"]))
    if "transformers" in results:
        rows.append(
            ("transformers output tokens/s", results["transformers"]["output_tokens_per_s"])
        )
    width = max(len(r[0]) for r in rows)
    lines = [f"ember bench offline: {results['model']} ({results['threads']} threads)"]
    lines += [f"  {name:<{width}}  {value:10.2f}" for name, value in rows]
    return "\n".join(lines)

"""Is HTTP the bottleneck? The same workload offline (`LLM.generate`) and through `ember serve`
with N concurrent streaming clients, plus the CPU an idle server burns.

    .venv/bin/python benchmarks/serve_overhead.py --concurrency 32 --prompt-tokens 128 \\
        --max-tokens 128 --repeats 3 --out /tmp/serve_overhead.json

Offline: all prompts at once to one in-process engine (its own best case: no HTTP, no
process hop, no detokenization wait). Served: the same prompts (token ids, distinct
random words) as streaming /v1/completions, greedy, ignore_eos, N at a time, through a
fresh `ember serve` with the same engine options. Output tok/s = output tokens / wall
time. Idle: CPU seconds used by the API and engine-core processes over --idle-seconds with
no requests, as a share of one core.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))

from peer_bench import print_table, run_batch, summarize  # noqa: E402

from ember import LLM, SamplingParams  # noqa: E402
from ember.loader.checkpoint import open_checkpoint  # noqa: E402
from ember.loader.default_models import resolve_model  # noqa: E402
from server_utils import EmberServer, child_pids  # noqa: E402


def build_prompts(tokenizer, n_tokens: int, count: int, seed: int) -> list[list[int]]:
    vocab = tokenizer.get_vocab()
    words = sorted(t[1:] for t in vocab if re.fullmatch(r"Ġ[a-z]{3,8}", t) and t[1:] in vocab)
    rng = random.Random(seed)
    prompts = []
    while len(prompts) < count:
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(n_tokens)))
        if len(ids) == n_tokens:
            prompts.append(ids)
    return prompts


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def engine_flags(args) -> list[str]:
    return [
        "--kv-cache-memory", args.kv_cache_memory, "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip


def run_offline(args, model: str, batches: list[list[list[int]]]) -> list[float]:
    llm = LLM(
        model,
        kv_cache_memory=int(args.kv_cache_memory.rstrip("M")) << 20,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
    )
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(batches[0][:4], params)  # warm-up
    rates = []
    for prompts in batches[1:]:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / wall)
    return rates


def run_served(args, model: str, batches: list[list[list[int]]]) -> tuple[list[dict], float]:
    server = EmberServer(model, *engine_flags(args))
    try:
        time.sleep(2)
        pids = [server.process.pid, *child_pids(server.process.pid)]
        before = sum(cpu_seconds(p) for p in pids)
        time.sleep(args.idle_seconds)
        idle = (sum(cpu_seconds(p) for p in pids) - before) / args.idle_seconds
        client = argparse.Namespace(
            url=server.url, model=None, max_tokens=args.max_tokens, extra="{}",
            concurrency=args.concurrency,
        )  # fmt: skip
        asyncio.run(run_batch(client, batches[0][:4]))  # warm-up
        runs = []
        for prompts in batches[1:]:
            wall, results = asyncio.run(run_batch(client, prompts))
            runs.append(summarize(wall, results))
        return runs, idle
    finally:
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: smollm2-135m")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--kv-cache-memory", default="1024M")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--idle-seconds", type=float, default=20.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    model = str(resolve_model(args.model))
    tokenizer = open_checkpoint(model).tokenizer()
    count = args.concurrency
    prompts = build_prompts(tokenizer, args.prompt_tokens, count * (args.repeats + 1), args.seed)
    batches = [prompts[i * count : (i + 1) * count] for i in range(args.repeats + 1)]

    offline = run_offline(args, model, batches)
    served, idle = run_served(args, model, batches)
    served_rates = [r["output_tok_s"] for r in served]
    ratio = statistics.median(served_rates) / statistics.median(offline)
    print(f"offline output tok/s: {[round(r, 1) for r in offline]}")
    print_table([(f"serve#{i}", r) for i, r in enumerate(served)])
    print(f"served / offline (medians): {ratio:.3f}")
    print(f"idle server CPU: {idle * 100:.2f}% of one core")
    if args.out:
        result = {"args": vars(args), "offline_tok_s": offline, "served": served,
                  "ratio": ratio, "idle_core_share": idle}  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

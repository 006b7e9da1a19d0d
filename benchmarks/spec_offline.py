"""Speculative decoding in process: one engine, its proposers swapped in turn.

    python benchmarks/spec_offline.py --model qwen2.5-coder-1.5b \\
        --draft-model qwen2.5-coder-0.5b --methods none ngram draft --rounds 2

One engine (prefix caching off, so every method computes the same prompts) serves the
same prompts with each method in turn, the order rotating each round, at batch 1 (one
request at a time) and 4 at once: output tokens per second end to end (prefill
included; at 4 at once, the time of the longest reply of each 4), the mean time from
the start of a run to each reply's end (what drafts do for each request's own wait),
drafts accepted, and whether every method's greedy output equals `none`'s.
Prompts (`--kind`): `edit`, code that the reply must give back changed (a rename in
one of ember's own source files as of commit SOURCE: replies that quote their context),
and `chat`, plain questions answered in prose. The adaptive mode plans each step's
drafts by cost (ember.engine.spec_planner) unless `--no-plan` (per-request budgets only).
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path

from ember import LLM, SamplingParams
from ember.engine.spec_planner import DraftPlanner
from ember.engine.speculative import NgramProposer, Speculator

ROOT = Path(__file__).resolve().parents[1]
SOURCE = "84888d9"  # the source files the edits quote, as of this commit
EDITS = [  # (file, lines, old name, new name)
    ("ember/engine/kv_cache.py", (37, 80), "hash_block", "block_digest"),
    ("ember/engine/step_cost.py", (1, 45), "StepShape", "StepWork"),
    ("ember/kv/buffers.py", (1, 40), "block_bytes", "bytes_per_block"),
    ("ember/engine/speculative.py", (53, 100), "lookup", "find_continuation"),
]
QUESTIONS = [
    "Explain how a hash map works and when it performs badly.",
    "Write a short story about a robot who learns to paint.",
    "What are the advantages and drawbacks of working from home?",
    "Describe the water cycle to a ten-year-old.",
]


def prompts(kind: str) -> list[list[dict]]:
    if kind == "chat":
        return [[{"role": "user", "content": q}] for q in QUESTIONS]
    out = []
    for path, (first, last), old, new in EDITS:
        text = subprocess.run(
            ["git", "show", f"{SOURCE}:{path}"], cwd=ROOT, capture_output=True, text=True,
            check=True,
        ).stdout  # fmt: skip
        code = "\n".join(text.splitlines()[first - 1 : last])
        ask = f"Rename `{old}` to `{new}` in this code and give back the whole code:\n\n"
        out.append([{"role": "user", "content": f"{ask}```python\n{code}\n```"}])
    return out


def run(llm: LLM, conversations, params, concurrency: int) -> tuple[float, float, list]:
    """(seconds in all, mean seconds from the start to each reply's end, outputs)."""
    core, ends = llm.engine.core, []
    step = core.step

    def timed_step():  # when each reply ends
        outputs = step()
        ends.extend(time.perf_counter() for o in outputs if o.finish_reason is not None)
        return outputs

    core.step = timed_step
    start, outs = time.perf_counter(), []
    try:
        for i in range(0, len(conversations), concurrency):
            outs += llm.chat(conversations[i : i + concurrency], params)
    finally:
        core.step = step
    wall = time.perf_counter() - start
    return wall, sum(t - start for t in ends) / max(len(ends), 1), outs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--methods", nargs="+", default=["none", "ngram"])
    p.add_argument("--kind", nargs="+", default=["edit", "chat"])
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", nargs="+", type=int, default=[1, 4])
    p.add_argument("--no-plan", action="store_true", help="adaptive budgets without the plan")
    args = p.parse_args()
    draft = {"speculative_method": "draft", "speculative_model": args.draft_model}
    llm = LLM(
        args.model, enable_prefix_caching=False, kv_cache_memory=2 << 30, max_model_len=4096,
        num_speculative_tokens=args.num_speculative_tokens, **(draft if args.draft_model else {}),
        speculative_disable_by_batch_size=args.disable_by_batch_size,
    )  # fmt: skip
    core = llm.engine.core
    speculators = {
        "none": None,
        "ngram": Speculator(
            NgramProposer(),
            args.num_speculative_tokens,
            disable_by_batch_size=args.disable_by_batch_size,
            planner=DraftPlanner(core.step_cost),
        ),  # fmt: skip
        "draft": core.speculator,
    }
    if args.no_plan:
        for speculator in speculators.values():
            if speculator is not None:
                speculator.planner = None
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    llm.chat(prompts("chat")[:1], SamplingParams(max_tokens=8))  # warm-up
    print(flush=True)  # (after the loading bars)
    for round_ in range(args.rounds):
        shift = round_ % len(args.methods)
        order = args.methods[shift:] + args.methods[:shift]
        for kind in args.kind:
            for concurrency in args.concurrency:
                outputs = {}
                for method in order:
                    core.speculator = speculators[method]
                    before = core.speculator.stats.as_dict() if core.speculator else None
                    wall, latency, outs = run(llm, prompts(kind), params, concurrency)
                    outputs[method] = [o.outputs[0].token_ids for o in outs]
                    line = f"{round_ + 1} {kind} c{concurrency} {method:6} "
                    line += f"{sum(map(len, outputs[method])) / wall:7.1f} output tok/s, "
                    line += f"replies end {latency:5.1f} s in on average"
                    if core.speculator is not None:
                        after = core.speculator.stats.as_dict()
                        drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
                        kept = after["num_accepted_tokens"] - before["num_accepted_tokens"]
                        line += f", {kept}/{drafted} drafts accepted"
                    print(line, flush=True)
                if "none" in outputs:
                    same = [m for m in outputs if m != "none" and outputs[m] == outputs["none"]]
                    print(f"  same output as none: {', '.join(same) or 'none of them'}")


if __name__ == "__main__":
    main()

"""What a step that carries a prompt chunk beside running decodes costs, in process.

    python benchmarks/mixed_steps.py [--decodes 7] [--tile-rows 48] [--profile 512]

The default model in bf16 (`matmul_precision="bf16"`, no step budget, no prefix cache),
its idle work done first (KV pages, calibration, oneDNN's primitives). `--decodes`
sequences decode throughout; then, for each chunk size, a prompt of that many tokens is
added (one output token) and the step that computes it timed, five times (medians, ms),
beside the decode-only steps' median. `--tile-rows N` sends every tiled matmul of up to N
rows to the int8 tiles (where bf16 takes them from 16 rows), an experiment: it changes
the prompt's numerics. `--profile N` prints cProfile's top functions over five steps
with an N-token chunk.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections.abc import Callable

import ember.models.layers as layers
from ember import LLM, SamplingParams


def settled_llm(**overrides) -> tuple[LLM, Callable[[int], list[int]]]:
    """The default model in bf16 (no step budget, no prefix cache; `overrides`: other
    engine options), its idle work done, and a maker of random prompts of n tokens."""
    options = dict(
        matmul_precision="bf16",
        kv_cache_memory=1 << 30,
        max_model_len=4096,
        enable_prefix_caching=False,
        max_step_ms=0,
    )
    llm = LLM(None, **(options | overrides))
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randint(1000, 40000) for _ in range(n)]

    llm.generate([prompt(300)], SamplingParams(max_tokens=4))
    while llm.engine.core.has_idle_work():
        llm.engine.core.idle_work()
    return llm, prompt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--decodes", type=int, default=7)
    p.add_argument("--chunks", default="8,16,27,41,64,128,256,384,512")
    p.add_argument("--tile-rows", type=int, default=0)
    p.add_argument("--profile", type=int, default=0)
    args = p.parse_args()
    llm, prompt = settled_llm()
    engine = llm.engine
    if args.tile_rows:
        layers.BF16_MIN_ROWS = args.tile_rows + 1
        layers.BLOCK_GEMM_MAX_ROWS = args.tile_rows
        for m in engine.core.runner.model.modules():
            if isinstance(m, layers.Linear) and m.int8_max_rows and m.blocks is not None:
                if m.blocks.dim() == 4:  # tiles
                    m.int8_max_rows = args.tile_rows
    decode = SamplingParams(max_tokens=3000, ignore_eos=True, temperature=0)
    one = SamplingParams(max_tokens=1, temperature=0)
    for i in range(args.decodes):
        engine.add_request(f"d{i}", engine.process_prompt(prompt(100)), decode)
    for _ in range(args.decodes + 2):
        engine.step()

    def step_ms() -> float:
        start = time.perf_counter()
        engine.step()
        return (time.perf_counter() - start) * 1e3

    print(
        f"decode-only, {args.decodes} sequences: {statistics.median(step_ms() for _ in range(9)):.1f} ms"
    )
    k = 0
    for n in map(int, args.chunks.split(",")):
        times = []
        for _ in range(5):
            engine.add_request(f"p{k}", engine.process_prompt(prompt(n)), one)
            k += 1
            times.append(step_ms())
            step_ms()
        print(f"{n} tokens + {args.decodes} decodes: {statistics.median(times):.1f} ms")
    if args.profile:
        profile = cProfile.Profile()
        for _ in range(5):
            engine.add_request(f"p{k}", engine.process_prompt(prompt(args.profile)), one)
            k += 1
            profile.enable()
            engine.step()
            profile.disable()
            step_ms()
        pstats.Stats(profile).sort_stats("tottime").print_stats(15)


if __name__ == "__main__":
    main()

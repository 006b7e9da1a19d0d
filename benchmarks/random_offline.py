"""The random serving workload replayed in process, step by step: 16 prompts of 286
random tokens, 64 new tokens each, 4 at a time (what `benchmarks/peer_ab.sh`'s random
workload sends), in bf16. Prints the wall time and the steps' time grouped by shape.

    python benchmarks/random_offline.py [--max-step-ms 100] [--kv-cache-dtype auto]
"""

from __future__ import annotations

import argparse
import collections
import random
import sys
from pathlib import Path

from ember.llm import LLM
from ember.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_offline import replay  # noqa: E402  (the same step loop and shape record)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-step-ms", type=float, default=100.0)
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    args = p.parse_args()
    llm = LLM(None, matmul_precision="bf16", kv_cache_memory=1 << 30, max_model_len=4096,
              max_step_ms=args.max_step_ms, kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    engine, rng = llm.engine, random.Random(1)
    prompts = [[rng.randrange(100, 40000) for _ in range(286)] for _ in range(16)]
    llm.generate([list(range(100, 400))], SamplingParams(max_tokens=4))  # warm-up
    params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
    wall, steps, shapes, *_ = replay(engine, prompts, params, concurrency=4)
    print(f"{wall:.2f} s, {len(steps)} steps, {16 * 64 / wall:.1f} output tok/s")
    kinds = collections.defaultdict(list)
    for seconds, shape in zip(steps, shapes, strict=False):
        kind = "decode only" if shape is None or not shape.num_prefill_tokens else "with prefill"
        kinds[kind, shape.num_decode_rows if shape else 0].append(seconds)
    for (kind, rows), times in sorted(kinds.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {kind}, {rows} decode rows: {len(times)} steps, {sum(times):.2f} s, "
              f"{1e3 * sum(times) / len(times):.1f} ms each")  # fmt: skip


if __name__ == "__main__":
    main()

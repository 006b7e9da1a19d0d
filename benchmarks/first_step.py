"""The first steps of a fresh engine core (the default model, in process): three 31-token
prompts, max_tokens 1, sent as soon as `EngineCore.from_config` returns (no idle slice
between: what a request sent as a server comes up meets). `none` turns off the 4 KB heads
of the KV pool (kv.buffers.Prefaulter's small_heads), to compare.

    python benchmarks/first_step.py heads
    python benchmarks/first_step.py none
"""

import argparse
import time

from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.kv import buffers
from ember.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("heads", choices=["heads", "none"])
    args = parser.parse_args()
    if args.heads == "none":
        init = buffers.Prefaulter.__init__

        def without_heads(self, *a, **k):
            init(self, *a, **(k | {"small_heads": False}))

        buffers.Prefaulter.__init__ = without_heads
    core = EngineCore.from_config(EngineConfig(model=None))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for i in range(3):
        prompt = list(range(100 + i, 131 + i))
        core.add_request(EngineCoreRequest(f"r{i}", prompt, params, 1, [2]))
        start = time.perf_counter()
        while core.has_unfinished():
            core.step()
        times.append((time.perf_counter() - start) * 1e3)
    heads = len(core.idle.prefaulter.heads)
    print(args.heads, " ".join(f"{x:.0f}" for x in times), f"ms; {heads} head regions")
    core.close()


if __name__ == "__main__":
    main()

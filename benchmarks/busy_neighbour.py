"""A prompt step's and a decode step's time, in process, with another process taking part
of a core: what a server's steps see while its API process streams, a client runs, or
a neighbour shares the machine.

    python benchmarks/busy_neighbour.py [--busy-ms 3] [--rest-ms 7] [--steps 20]

The default model on its defaults (no step budget, no prefix cache), its idle work done.
Each round times `--steps` steps of a 286-token prompt (one output token) and of four
sequences decoding, alone and then beside a process that spins `--busy-ms` and sleeps
`--rest-ms` in turn (30% of a core by default). Prints mean / p50 / p90 ms per step.
For two trees, run each with its directory first on PYTHONPATH, in turn.
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

from ember import LLM, SamplingParams

NEIGHBOUR = """
import sys, time
busy, rest = float(sys.argv[1]) / 1e3, float(sys.argv[2]) / 1e3
while True:
    start = time.perf_counter()
    while time.perf_counter() - start < busy:
        pass
    time.sleep(rest)
"""


def summary(times: list[float]) -> str:
    ordered = sorted(times)
    p90 = ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]
    return f"{statistics.mean(times):.1f} / {statistics.median(times):.1f} / {p90:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-ms", type=float, default=3.0)
    parser.add_argument("--rest-ms", type=float, default=7.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    llm = LLM(None, kv_cache_memory=1 << 30, max_model_len=4096, enable_prefix_caching=False,
              max_step_ms=0)
    engine = llm.engine
    while engine.core.has_idle_work():
        engine.core.idle_work()
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randint(1000, 40000) for _ in range(n)]

    def timed_step() -> float:
        start = time.perf_counter()
        engine.step()
        return (time.perf_counter() - start) * 1e3

    def prompt_steps() -> list[float]:
        times = []
        for i in range(args.steps):
            engine.add_request(f"p{rng.random()}", engine.process_prompt(prompt(286)),
                               SamplingParams(max_tokens=1))
            times.append(timed_step())
            while engine.has_unfinished():
                engine.step()
        return times

    def decode_steps() -> list[float]:
        params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
        for i in range(4):
            engine.add_request(f"d{rng.random()}", engine.process_prompt(prompt(300)), params)
        for _ in range(4):  # their prompts
            engine.step()
        times = [timed_step() for _ in range(args.steps)]
        while engine.has_unfinished():
            engine.step()
        return times

    prompt_steps()  # warm
    for round_ in range(1, args.rounds + 1):
        for busy in (False, True):
            neighbour = None
            if busy:
                neighbour = subprocess.Popen(
                    [sys.executable, "-c", NEIGHBOUR, str(args.busy_ms), str(args.rest_ms)]
                )
            try:
                p, d = prompt_steps(), decode_steps()
            finally:
                if neighbour is not None:
                    neighbour.kill()
                    neighbour.wait()
            label = "beside a busy process" if busy else "alone"
            print(f"round {round_} {label:22s} prompt {summary(p)}  decode {summary(d)}")


if __name__ == "__main__":
    main()

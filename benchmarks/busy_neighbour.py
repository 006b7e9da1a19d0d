"""A prompt step's and a decode step's time, in process, with another process taking part
of a core: what a server's steps see while its API process streams, a client runs, or
a neighbour shares the machine.

    python benchmarks/busy_neighbour.py [--busy-ms 3] [--rest-ms 7] [--steps 20] [--gemm]

The default model on its defaults (no step budget, no prefix cache), its idle work done.
Each round times `--steps` steps of a 286-token prompt (one output token) and of four
sequences decoding, alone and then beside a process that spins `--busy-ms` and sleeps
`--rest-ms` in turn (30% of a core by default). Prints mean / p50 / p90 ms per step.
`--gemm`: the int8 tiles' GEMM instead, SmolLM2's four Q4_1 shapes in turn at a
prefill's 760 rows and a decode's 16 (ms for the four). For two trees, run each with its
directory first on PYTHONPATH, in turn.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

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
    return " / ".join(f"{t:.3g}" for t in (statistics.mean(times), statistics.median(times), p90))


def gemm_calls() -> dict[str, Callable[[], None]]:
    """The four shapes' int8 tiles GEMMs at 760 and 16 rows, a call each."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from kquant_gemm import random_blocks  # random codes, small fp16 scales
    from prefill_matmuls import SHAPES  # gate_up, down, qkv, o

    from ember.engine.kernels import cpu_kernels
    from ember.models.tiles import tile_blocks

    kernels = cpu_kernels()
    torch.manual_seed(0)
    weights = [
        (tile_blocks(random_blocks("Q4_1", n, k).view(n, k // 32, 20), kernels), k)
        for n, k in SHAPES
    ]
    calls = {}
    for rows in (760, 16):
        xs = [(w, torch.randn(rows, k)) for w, k in weights]
        calls[f"{rows} rows"] = lambda xs=xs: [
            kernels.tiled_gemm_int8(x, w, None, True) for w, x in xs
        ]
    return calls


def beside_neighbour(busy: bool, args, measure: Callable[[], str]) -> str:
    neighbour = None
    if busy:
        neighbour = subprocess.Popen(
            [sys.executable, "-c", NEIGHBOUR, str(args.busy_ms), str(args.rest_ms)]
        )
    try:
        return measure()
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def timed(fn: Callable[[], object], repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--busy-ms", type=float, default=3.0)
    parser.add_argument("--rest-ms", type=float, default=7.0)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--gemm", action="store_true")
    args = parser.parse_args()
    if args.gemm:
        calls = gemm_calls()
        for fn in calls.values():
            timed(fn, 3)  # warm
        for round_ in range(1, args.rounds + 1):
            for busy in (False, True):
                line = beside_neighbour(busy, args, lambda: "  ".join(
                    f"{name} {summary(timed(fn, 60 if name.startswith('760') else 400))}"
                    for name, fn in calls.items()
                ))  # fmt: skip
                label = "beside a busy process" if busy else "alone"
                print(f"round {round_} {label:22s} {line}")
        return
    llm = LLM(
        None,
        kv_cache_memory=1 << 30,
        max_model_len=4096,
        enable_prefix_caching=False,
        max_step_ms=0,
    )
    engine = llm.engine
    while engine.core.has_idle_work():
        engine.core.idle_work()
    rng = random.Random(0)
    ids = itertools.count()

    def prompt(n: int) -> list[int]:
        return [rng.randint(1000, 40000) for _ in range(n)]

    def timed_step() -> float:
        return timed(engine.step, 1)[0]

    def prompt_steps() -> list[float]:
        times = []
        for _ in range(args.steps):
            engine.add_request(
                f"p{next(ids)}", engine.process_prompt(prompt(286)), SamplingParams(max_tokens=1)
            )
            times.append(timed_step())
            while engine.has_unfinished():
                engine.step()
        return times

    def decode_steps() -> list[float]:
        params = SamplingParams(max_tokens=args.steps + 8, ignore_eos=True, temperature=0)
        for _ in range(4):
            engine.add_request(f"d{next(ids)}", engine.process_prompt(prompt(300)), params)
        for _ in range(4):  # their prompts
            engine.step()
        times = [timed_step() for _ in range(args.steps)]
        while engine.has_unfinished():
            engine.step()
        return times

    prompt_steps()  # warm
    for round_ in range(1, args.rounds + 1):
        for busy in (False, True):
            line = beside_neighbour(
                busy,
                args,
                lambda: f"prompt {summary(prompt_steps())}  decode {summary(decode_steps())}",
            )
            label = "beside a busy process" if busy else "alone"
            print(f"round {round_} {label:22s} {line}")


if __name__ == "__main__":
    main()

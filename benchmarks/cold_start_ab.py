"""Cold start of `ember serve` against llama.cpp's `llama-server` on the same GGUF file,
one start of each in turn (so that both meet the same load on a noisy box).

Each start: evict the file from the page cache (unless --warm), spawn the server, poll
/health until 200, send one chat completion (max_tokens 1), stop it. Printed per run:
seconds from spawn to /health 200 and to the first answer, and the CPU seconds the
server's processes used; then the medians and their ratio.

    python benchmarks/cold_start_ab.py LLAMA_SERVER [--model FILE] [--repeats 5] [--warm]
        [--threads 2] [--ember-arg=--max-model-len=2048 ...]

LLAMA_SERVER: llama.cpp's server (built as for llamacpp_b1.sh, `--target llama-server`).
It starts with `-c 2048 -t THREADS` (a context as large as ember's default here); ember
with its defaults plus --ember-arg.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import httpx

from ember.bench.startup import (
    children_cpu_s,
    evict,
    first_chat,
    free_port,
    stop_server,
    wait_ready,
)
from ember.loader.default_models import resolve_model


def start(command: list[str], url: str) -> dict:
    """One start of `command`: spawn -> /health 200 -> first chat answer -> stop."""
    cpu_before = children_cpu_s()
    env = dict(os.environ, EMBER_LOG_LEVEL="WARNING")
    with tempfile.TemporaryFile() as log, httpx.Client() as client:
        t0 = time.perf_counter()
        process = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            ready = wait_ready(process, url, log, name=command[0], client=client) - t0
            first = first_chat(url, client) - t0
        finally:
            stop_server(process)
    return {"ready_s": ready, "first_chat_s": first, "cpu_s": children_cpu_s() - cpu_before}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_server")
    parser.add_argument("--model", default=None, help="a GGUF file (default: ember's default)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warm", action="store_true", help="leave the file in the page cache")
    parser.add_argument("--ember-arg", action="append", default=[])
    args = parser.parse_args()
    model = resolve_model(args.model)
    sides = {
        "ember": lambda port: [
            sys.executable, "-m", "ember.cli", "serve", str(model), "--port", str(port),
            *args.ember_arg,
        ],
        "llama.cpp": lambda port: [
            args.llama_server, "-m", str(model), "--port", str(port), "--host", "127.0.0.1",
            "-c", "2048", "-t", str(args.threads),
        ],
    }  # fmt: skip
    cache = "warm" if args.warm else "evicted"
    print(f"{model.name}, page cache {cache}, {args.repeats} rounds, alternating")
    print(f"{'round':<6}{'server':<11}{'ready_s':>8}{'first_chat_s':>14}{'cpu_s':>7}")
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    for i in range(args.repeats):
        order = list(sides) if i % 2 == 0 else list(reversed(sides))
        for name in order:
            if not args.warm:
                evict([model])
            port = free_port()
            run = start(sides[name](port), f"http://127.0.0.1:{port}")
            runs[name].append(run)
            print(
                f"{i:<6}{name:<11}{run['ready_s']:>8.2f}{run['first_chat_s']:>14.2f}"
                f"{run['cpu_s']:>7.2f}",
                flush=True,
            )
    medians = {
        name: {key: statistics.median(r[key] for r in found) for key in found[0]}
        for name, found in runs.items()
    }
    for name, median in medians.items():
        print(
            f"median {name}: ready {median['ready_s']:.2f} s, first chat "
            f"{median['first_chat_s']:.2f} s, {median['cpu_s']:.2f} CPU s"
        )
    ratio = medians["ember"]["first_chat_s"] / medians["llama.cpp"]["first_chat_s"]
    print(f"ember / llama.cpp, first chat: {ratio:.2f}x")


if __name__ == "__main__":
    main()

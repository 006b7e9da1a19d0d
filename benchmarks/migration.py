"""What moving a stream costs its client: the longest gap between two events of a stream
whose worker is killed (SIGKILL) mid-way, against the same stream undisturbed.

    python benchmarks/migration.py [MODEL] [--prompt-tokens 1500] [--rounds 3]

`ember up --mixed 2 --pin` on this machine (the default model unless MODEL). Each round
streams one greedy request of about --prompt-tokens tokens and 96 output tokens, three
ways:
  undisturbed   nothing happens (its longest gap is an ordinary step);
  warm          its worker killed after 32 events; the prompt had been sent to both
                workers first, so the other's prefix cache holds it and only the 32
                streamed tokens are recomputed there;
  cold          the same with a prompt no worker has seen: the other worker recomputes
                prompt + 32 tokens before it goes on.
Each moved stream's text is compared with the undisturbed one's: under exact fp32
(EMBER_MATMUL_PRECISION=ieee) they are the same; under bf16 prefill (the default "auto"
on CPUs with AVX512-BF16) the recomputed KV differs by bf16 rounding, and a greedy stream
may take another token where two were that close. The killed worker is started again by
`ember up` before the next case. Prints one line per round and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))
from ember.cluster import router_token  # noqa: E402
from server_utils import child_pids, pid_serving  # noqa: E402

KILL_AFTER = 32  # events
OUTPUT_TOKENS = 96


def stream(url: str, prompt: str, kill: bool, headers=None) -> tuple[str, float]:
    """(text, longest gap between events in s) of one streamed completion."""
    body = {"prompt": prompt, "max_tokens": OUTPUT_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text, gaps, last, count = "", [], None, 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers,
                      timeout=600) as response:  # fmt: skip
        worker = response.headers.get("x-ember-worker")
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last, count = now, count + 1
            text += json.loads(line[6:])["choices"][0]["text"]
            if kill and count == KILL_AFTER:
                pid = pid_serving(worker)
                for each in [*child_pids(pid), pid]:
                    os.kill(each, signal.SIGKILL)
    return text, max(gaps)


def wait_all_healthy(url: str) -> None:
    while True:
        workers = httpx.get(f"{url}/load", timeout=5).json()["workers"]
        if all(w["healthy"] for w in workers):
            return
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--prompt-tokens", type=int, default=1500)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    port = 8731
    url = f"http://127.0.0.1:{port}"
    secret = secrets.token_hex(16)  # the cluster's: this script calls workers directly too
    worker_headers = {"x-ember-router-token": router_token(secret.encode())}
    command = [sys.executable, "-m", "ember.cli", "up", *([args.model] if args.model else []),
               "--mixed", "2", "--pin", "--port", str(port), "--worker-port", str(port + 1),
               "--max-model-len", "4096", "--kv-cache-memory", "256M",
               "--worker-restarts", "100"]  # fmt: skip
    env = dict(os.environ, EMBER_LOG_LEVEL="WARNING", EMBER_CLUSTER_SECRET=secret)
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert f"{url}/v1" in up.stdout.readline()
        workers = [w["url"] for w in httpx.get(f"{url}/load").json()["workers"]]
        words = "Agents resend their whole context every turn, tool results and all. "
        gaps: dict[str, list[float]] = {"undisturbed": [], "warm": [], "cold": []}
        same = {"warm": 0, "cold": 0}  # moved streams whose text is the undisturbed one's
        for round_ in range(args.rounds):
            prompt = f"Round {round_}. " + words * (args.prompt_tokens // 14)
            for worker in workers:  # both hold the prompt
                want, _ = stream(worker, prompt, kill=False, headers=worker_headers)
            got, gap = stream(url, prompt, kill=False)
            assert got == want
            gaps["undisturbed"].append(gap)
            got, gap = stream(url, prompt, kill=True)
            same["warm"] += got == want
            gaps["warm"].append(gap)
            wait_all_healthy(url)
            cold = f"Cold {round_}. " + words * (args.prompt_tokens // 14)  # seen by none
            got, gap = stream(url, cold, kill=True)
            want, _ = stream(url, cold, kill=False)
            same["cold"] += got == want
            gaps["cold"].append(gap)
            wait_all_healthy(url)
            print(f"round {round_}: longest gap undisturbed {gaps['undisturbed'][-1]:.3f} s, "
                  f"moved warm {gaps['warm'][-1]:.3f} s, moved cold {gaps['cold'][-1]:.3f} s",
                  flush=True)  # fmt: skip
        for case, values in gaps.items():
            equal = f", {same[case]} of {args.rounds} the same text" if case in same else ""
            print(f"{case}: median longest gap {statistics.median(values):.3f} s{equal}")
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(60)


if __name__ == "__main__":
    main()

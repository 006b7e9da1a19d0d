"""Soak: a cluster under mixed agentic and random load for a long while, with clients
that leave mid-way and one worker killed a minute; the resident memory of every process
sampled throughout. Not part of any test suite.

    python benchmarks/soak.py [MODEL] [--minutes 30] [--out /tmp/soak.json]

`ember up --mixed 2 --pin` (the default model unless MODEL). Load: 4 agent sessions
(x-session-affinity; each turn resends the whole conversation plus a new message, the
context growing until it nears the context length, then the session starts over) and 2
random single prompts at a time, all streamed, greedy, 32-64 output tokens; one request
in ten leaves after a few events. Every 60 s, when both workers are healthy, one is
killed: its API process and core (ember up starts it again) or its core alone (its API
process restarts it), in turn. RSS (VmRSS) of the router and of each worker's API and
core process is read every 10 s (pids found again after restarts).

Reports, per kind of process, the median RSS over the second fifth of the run (after
warm-up) and over the last fifth, and the drift between them (target: under 5%); the
requests, client-visible errors (target 0; a stream that ends with an error event or a
status other than 200, clients that left on purpose not counted), kills and streams
moved.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from server_utils import child_pids, pid_serving  # noqa: E402

WORDS = "the agent reads the tool result and decides what to call next with which args ".split()


def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


class Soak:
    def __init__(self, url: str, workers: list[str], up_pid: int, max_chars: int) -> None:
        self.url, self.workers, self.up_pid, self.max_chars = url, workers, up_pid, max_chars
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.counts = {"requests": 0, "left on purpose": 0, "client-visible errors": 0,
                       "workers killed": 0, "engine cores killed": 0}  # fmt: skip
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.chunks: list[int] = []  # the router's prefix-table entries, at each sample

    def count(self, key: str) -> None:
        with self.lock:
            self.counts[key] += 1

    def request(self, rng: random.Random, messages: list, session: str | None) -> str:
        body = {"messages": messages, "max_tokens": rng.randint(32, 64), "temperature": 0,
                "stream": True}  # fmt: skip
        headers = {"x-session-affinity": session} if session else {}
        leave = rng.random() < 0.1
        text, events = "", 0
        self.count("requests")
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body,
                              headers=headers, timeout=300) as response:  # fmt: skip
                if response.status_code != 200:
                    self.count("client-visible errors")
                    return ""
                for line in response.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    events += 1
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.count("client-visible errors")
                        return ""
                    for choice in chunk["choices"]:
                        text += (choice.get("delta") or {}).get("content") or ""
                    if leave and events == 3:
                        self.count("left on purpose")
                        return text
        except httpx.HTTPError:
            self.count("client-visible errors")
        return text

    def agent(self, index: int) -> None:
        rng = random.Random(index)
        while not self.stop.is_set():
            session, messages = f"soak-{index}-{rng.random():.6f}", []
            while not self.stop.is_set():
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 120)))
                messages.append({"role": "user", "content": words})
                if sum(len(m["content"]) for m in messages) > self.max_chars:
                    break
                messages.append({"role": "assistant",
                                 "content": self.request(rng, messages, session) or "ok"})  # fmt: skip

    def random_load(self, index: int) -> None:
        rng = random.Random(1000 + index)
        while not self.stop.is_set():
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 400)))
            self.request(rng, [{"role": "user", "content": words}], None)

    def killer(self) -> None:
        rng, turn = random.Random(0), 0
        while not self.stop.wait(60):
            load = httpx.get(f"{self.url}/load", timeout=10).json()
            if not all(w["healthy"] for w in load["workers"]):
                continue
            pid = pid_serving(rng.choice(self.workers))
            if turn % 2 == 0:
                for each in [*child_pids(pid), pid]:
                    os.kill(each, signal.SIGKILL)
                self.count("workers killed")
            else:
                os.kill(child_pids(pid)[0], signal.SIGKILL)
                self.count("engine cores killed")
            turn += 1

    def sampler(self, start: float) -> None:
        while not self.stop.wait(10):
            sample: dict[str, float] = {}
            router = [p for p in child_pids(self.up_pid) if b"router" in _cmdline(p)]
            for pid in router:
                sample["router"] = rss_mb(pid) or 0.0
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                workers = httpx.get(f"{self.url}/load", timeout=10).json()["workers"]
                # the router's prefix table: an LRU that grows to its bound, not a leak
                self.chunks.append(sum(w["prefix_chunks"] for w in workers))
            for i, url in enumerate(self.workers):
                try:
                    api = pid_serving(url)
                except AssertionError:
                    continue  # being started again
                sample[f"worker {i} api"] = rss_mb(api) or 0.0
                for core in child_pids(api):
                    sample[f"worker {i} core"] = rss_mb(core) or 0.0
            self.samples.append((time.monotonic() - start, sample))


def _fifths(values: list[int]) -> dict[str, float]:
    """The mean over the second fifth of a run and over its last fifth (as `drift`)."""
    n = len(values)
    early, late = values[n // 5 : 2 * n // 5], values[4 * n // 5 :]
    return {"after_warmup": round(statistics.mean(early or [0])),
            "at_end": round(statistics.mean(late or [0]))}  # fmt: skip


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def drift(samples: list[tuple[float, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per process: the median RSS over the second fifth of the run and the last fifth."""
    n = len(samples)
    early, late = samples[n // 5 : 2 * n // 5], samples[4 * n // 5 :]
    out = {}
    for name in sorted({k for _, s in samples for k in s}):
        a = [s[name] for _, s in early if name in s]
        b = [s[name] for _, s in late if name in s]
        if a and b:
            before, after = statistics.median(a), statistics.median(b)
            out[name] = {"mb_after_warmup": round(before, 1), "mb_at_end": round(after, 1),
                         "drift_percent": round(100 * (after - before) / before, 2)}  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--out", default="/tmp/soak.json")
    args = parser.parse_args()
    port = 8751
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "ember.cli", "up", *([args.model] if args.model else []),
               "--mixed", "2", "--pin", "--port", str(port), "--worker-port", str(port + 1),
               "--max-model-len", "4096", "--kv-cache-memory", "512M",
               "--worker-restarts", "1000", "--engine-restarts", "1000"]  # fmt: skip
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True,
                          env=dict(os.environ, EMBER_LOG_LEVEL="WARNING"))  # fmt: skip
    try:
        assert f"{url}/v1" in up.stdout.readline()
        workers = [w["url"] for w in httpx.get(f"{url}/load").json()["workers"]]
        soak = Soak(url, workers, up.pid, max_chars=8000)
        start = time.monotonic()
        threads = [threading.Thread(target=soak.agent, args=(i,)) for i in range(4)]
        threads += [threading.Thread(target=soak.random_load, args=(i,)) for i in range(2)]
        threads += [threading.Thread(target=soak.killer),
                    threading.Thread(target=soak.sampler, args=(start,))]  # fmt: skip
        for thread in threads:
            thread.start()
        soak.stop.wait(args.minutes * 60)
        soak.stop.set()
        for thread in threads:
            thread.join(timeout=600)
        decisions = httpx.get(f"{url}/load", timeout=10).json()["decisions"]
        result = {"minutes": args.minutes, **soak.counts,
                  "streams moved": decisions.get("migrate", 0),
                  "requests re-sent": decisions.get("retry", 0),
                  "rss": drift(soak.samples),
                  "router prefix chunks": _fifths(soak.chunks),
                  "samples": soak.samples}  # fmt: skip
        Path(args.out).write_text(json.dumps(result, indent=1))
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=1))
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)


if __name__ == "__main__":
    main()

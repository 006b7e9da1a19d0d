"""Overload: a cluster of two mixed workers (each at most 8 waiting sequences) is first
measured at capacity (16 clients, each sending its next request as soon as the last is
answered), then offered far more (400 clients, no pause between attempts; one in ten
sends a 256 KiB prompt the context cannot hold). The cluster must keep serving about as
much as at capacity, refuse the rest with a 429 and its Retry-After (or a 503 coded
too_many_connections), answer no other 5xx, and keep every process's memory bounded:
the resident set of each is sampled throughout."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from conftest import report
from server_utils import Up, child_pids

CAPACITY_CLIENTS, CAPACITY_SECONDS = 16, 10
CLIENTS, SECONDS = 400, 20
PROMPTS = [f"Overload prompt {i}: agents resend their whole context every turn. " * 3
           for i in range(8)]  # fmt: skip
HUGE = "word " * (256 * 1024 // 5)  # a 256 KiB prompt: a 400 (longer than the context)
RSS_GROWTH_BOUND = 256 << 20  # what any one process may grow by under overload


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        pids.append(todo.pop())
        todo += child_pids(pids[-1])
    return pids


def _rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _name(pid: int) -> str:
    args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    if b"up" in args:
        return f"ember up {pid}"
    if b"router" in args:
        return f"router {pid}"
    if b"serve" in args:
        return f"worker {pid}"
    return f"engine core {pid}"


class RssSampler:
    """Every process of a tree, its resident set sampled every 0.2 s; `peak()` per name."""

    def __init__(self, root: int) -> None:
        self.names = {pid: _name(pid) for pid in _tree(root)}
        self.samples: dict[str, list[int]] = {name: [] for name in self.names.values()}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            for pid, name in self.names.items():
                try:
                    self.samples[name].append(_rss(pid))
                except OSError:
                    pass

    def mark(self) -> dict[str, int]:
        """How many samples each process has so far (to split phases)."""
        return {name: len(s) for name, s in self.samples.items()}

    def peak(self, since: dict[str, int] | None = None) -> dict[str, int]:
        since = since or {}
        return {name: max(s[since.get(name, 0) :], default=0) for name, s in self.samples.items()}

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


async def _closed_loop(url: str, clients: int, seconds: float, huge_share: float) -> dict:
    """`clients` each sending a request as soon as the last one ended, for `seconds`."""
    seen = {"attempts": 0, "200": 0, "429": 0, "400": 0, "503 too_many_connections": 0,
            "other": 0, "429 without Retry-After": 0, "errors not OpenAI": 0,
            "connection failed": 0}  # fmt: skip
    deadline = time.monotonic() + seconds
    kinds = seen["kinds"] = Counter()
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client(index: int, http: httpx.AsyncClient) -> None:
        rng = random.Random(index)
        while time.monotonic() < deadline:
            huge = rng.random() < huge_share
            body = {"prompt": HUGE if huge else rng.choice(PROMPTS), "temperature": 0,
                    "max_tokens": rng.randint(4, 24)}  # fmt: skip
            seen["attempts"] += 1
            try:
                reply = await http.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError as exc:
                seen["connection failed"] += 1
                kind = f"{type(exc).__name__}: {exc}"[:120]
                kinds[kind] += 1
                await asyncio.sleep(0.05)
                continue
            code = reply.status_code
            if code != 200:
                try:
                    error = reply.json()["error"]
                    assert isinstance(error["message"], str) and "type" in error
                except (ValueError, KeyError, TypeError, AssertionError):
                    seen["errors not OpenAI"] += 1
                    error = {}
            if code == 429 and "retry-after" not in reply.headers:
                seen["429 without Retry-After"] += 1
            if code == 503 and error.get("code") == "too_many_connections":
                seen["503 too_many_connections"] += 1
            elif str(code) in seen:
                seen[str(code)] += 1
            else:
                seen["other"] += 1
                kind = f"HTTP {code}: {reply.text[:100]}"
                kinds[kind] += 1

    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        await asyncio.gather(*(client(i, http) for i in range(clients)))
    return seen


def test_overload_is_refused_not_absorbed(tiny_model):
    up = Up(tiny_model, "--mixed", "2", "--max-queued-requests", "8",
            "--max-connections", "256")  # fmt: skip
    try:
        rss = RssSampler(up.process.pid)
        try:
            at_capacity = asyncio.run(_closed_loop(up.url, CAPACITY_CLIENTS, CAPACITY_SECONDS, 0))
            warm = rss.peak()
            since = rss.mark()
            over = asyncio.run(_closed_loop(up.url, CLIENTS, SECONDS, 0.1))
            peak = rss.peak(since)
        finally:
            rss.stop()
        up.wait_no_blocks(timeout=60)
        assert httpx.get(f"{up.url}/health").status_code == 200
        served, offered = at_capacity["200"] / CAPACITY_SECONDS, over["attempts"] / SECONDS
        served_over = over["200"] / SECONDS
        growth = {name: peak[name] - warm[name] for name in peak}
        report("overload", {
            "served at capacity /s": round(served, 1), "offered /s": round(offered, 1),
            "served under overload /s": round(served_over, 1),
            "attempts": over["attempts"], "200": over["200"], "429": over["429"],
            "503 too_many_connections": over["503 too_many_connections"],
            "400 (prompt too long)": over["400"], "other": over["other"],
            "peak RSS MiB": {n: round(v / 2**20) for n, v in peak.items()},
            "RSS growth MiB": {n: round(v / 2**20, 1) for n, v in growth.items()}})  # fmt: skip
        assert at_capacity["200"] == at_capacity["attempts"] > 0
        assert over["other"] == over["connection failed"] == 0, over["kinds"]
        assert over["429 without Retry-After"] == over["errors not OpenAI"] == 0, over
        assert over["429"] > 0 and over["503 too_many_connections"] > 0  # both bounds met
        assert served_over >= 0.4 * served  # still serving (the clients share its 2 cores)
        assert all(g < RSS_GROWTH_BOUND for g in growth.values()), growth
    finally:
        up.stop()

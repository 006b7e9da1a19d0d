"""Disconnect storms: 1,000 clients against a cluster (mixed, and disaggregated), each
leaving at a random point (before its answer, mid-stream, or not at all). Afterwards
every worker is idle with no KV block in use or held, and the router counts nothing in
flight."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from conftest import report
from server_utils import Up

CLIENTS = 1000
AT_ONCE = 48
PROMPTS = [f"Storm prompt {i}: agents resend their whole context every turn. " * 3
           for i in range(8)]  # fmt: skip


async def client(http: httpx.AsyncClient, url: str, rng: random.Random, seen: dict) -> None:
    stream = rng.random() < 0.6
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": rng.randint(1, 64),
            "temperature": rng.choice([0, 1.0]), "stream": stream}  # fmt: skip
    path = rng.choice(["/v1/completions", "/v1/chat/completions"])
    if path.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": body.pop("prompt")}]
    leave_after = rng.choice([None, 0, 1, 2, 5, 10])  # events (or, not streaming: steps)
    try:
        if stream:
            async with http.stream("POST", f"{url}{path}", json=body) as response:
                events = 0
                async for line in response.aiter_lines():
                    events += line.startswith("data: ")
                    if leave_after is not None and events > leave_after:
                        seen["left mid-stream"] += 1
                        return  # closes the connection
            seen["finished"] += 1
        elif leave_after is None:
            assert (await http.post(f"{url}{path}", json=body)).status_code == 200
            seen["finished"] += 1
        else:
            await asyncio.wait_for(http.post(f"{url}{path}", json=body), 0.01 * leave_after)
            seen["finished"] += 1
    except TimeoutError:
        seen["left before the answer"] += 1


async def storm(url: str, seed: int) -> dict:
    rng = random.Random(seed)
    seen = {"finished": 0, "left mid-stream": 0, "left before the answer": 0}
    limits = httpx.Limits(max_connections=AT_ONCE)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        gate = asyncio.Semaphore(AT_ONCE)

        async def one():
            async with gate:
                await client(http, url, rng, seen)

        await asyncio.gather(*(one() for _ in range(CLIENTS)))
    return seen


@pytest.mark.parametrize("layout", [["--mixed", "2"], ["--prefill", "1", "--decode", "1"]],
                         ids=["mixed", "disaggregated"])  # fmt: skip
def test_a_disconnect_storm_leaves_nothing_behind(tiny_model, layout):
    up = Up(tiny_model, *layout)
    try:
        start = time.monotonic()
        seen = asyncio.run(storm(up.url, seed=len(layout)))
        up.wait_no_blocks(timeout=60)
        for worker in up.workers:
            load = up.worker_load(worker)
            assert load["num_running"] == load["num_waiting"] == 0, load
        router = up.load()["workers"]
        assert all(w["requests_in_flight"] == 0 and w["tokens_in_flight"] == 0 for w in router)
        assert httpx.get(f"{up.url}/health").status_code == 200
        report(f"disconnect storm {'-'.join(layout).replace('--', '')}", {
            "clients": CLIENTS, **seen, "KV blocks leaked": 0,
            "seconds": round(time.monotonic() - start, 1)})  # fmt: skip
    finally:
        up.stop()

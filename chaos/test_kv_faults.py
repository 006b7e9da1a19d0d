"""KV transfers that fail under load: a disaggregated cluster whose decode worker's
transport (the fake one, over TCP) delays, drops, refuses or corrupts every transfer,
with six clients streaming greedy requests. The decode worker falls back to computing
the prompt itself (a corrupted transfer is caught by the checksum): every stream must end
with the text a single worker gives, and no block may stay used or held."""

from __future__ import annotations

import functools
import threading

import httpx
import pytest

from conftest import report, run_for
from server_utils import WORKER_ARGS, EmberServer, Up

SECONDS = 15
CLIENTS = 6
PROMPTS = [f"Tenant {i}: the agent resends its context with every tool result. " * 3
           for i in range(6)]  # fmt: skip
BODY = {"max_tokens": 24, "temperature": 0, "ignore_eos": True}
FAULTS = ["delay:0.2", "drop", "fail", "corrupt"]


@pytest.fixture(scope="module")
def reference(tiny_model):
    server = EmberServer(tiny_model, *WORKER_ARGS)
    yield server
    server.stop()


@pytest.mark.parametrize("fault", FAULTS)
def test_failing_kv_transfers_fall_back_to_recompute(tiny_model, reference, fault):
    from test_migration import read_stream  # one stream's client view

    up = Up(tiny_model, "--prefill", "1", "--decode", "1", "--kv-transport", "fake",
            "--kv-fake-fault", fault, "--kv-load-timeout", "1", "--kv-checksum")  # fmt: skip
    try:
        body = dict(BODY, stream=True, stream_options={"include_usage": True})
        want = {p: httpx.post(f"{reference.url}/v1/completions", json=dict(BODY, prompt=p),
                              timeout=60).json()["choices"][0]["text"] for p in PROMPTS}  # fmt: skip
        stop, seen, lock = threading.Event(), {"streams": 0, "wrong or failed": 0}, threading.Lock()

        def load(index: int) -> None:
            turn = 0
            while not stop.is_set():
                prompt = PROMPTS[(index + turn) % len(PROMPTS)]
                turn += 1
                try:
                    view, _ = read_stream(up.url, dict(body, prompt=prompt))
                    ok = view["text"] == want[prompt] and view["done"] == 1
                except AssertionError:
                    ok = False
                with lock:
                    seen["streams"] += 1
                    seen["wrong or failed"] += not ok

        run_for(SECONDS, stop, *[functools.partial(load, i) for i in range(CLIENTS)])
        (decode,) = up.urls("decode")
        transfer = up.worker_load(decode)["kv_transfer"]
        report(f"kv transfers {fault}", {**seen, "loads ok": transfer["loads_ok"],
                                         "loads failed": transfer["loads_failed"]})  # fmt: skip
        assert seen["wrong or failed"] == 0 and seen["streams"] > 0
        if fault != "delay:0.2":
            assert transfer["loads_ok"] == 0 and transfer["loads_failed"] > 0
        up.wait_no_blocks(timeout=60)
    finally:
        up.stop()

"""Kills under load: agent-like streams (greedy, so each has one right answer) run
against `ember up --mixed 2`, and against one prefill and two decode workers, while,
every few seconds and only when every worker is healthy, one worker is killed (SIGKILL of its API process and engine core, which `ember
up` starts again) or only its engine core (which its API process starts again). Every
stream must finish with the undisturbed text and usage: the cluster could always have
served it, so a client-visible error is a failure."""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import threading
import time

import httpx
import pytest

from conftest import report, run_for
from server_utils import Up, child_pids, pid_serving

CHAOS_SECONDS = 60
KILL_EVERY_S = 4.0
CLIENTS = 6
PROMPTS = [f"Session {i}: the agent resends its whole context, tool results and all. " * 4
           for i in range(6)]  # fmt: skip
BODY = {"max_tokens": 48, "temperature": 0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True}}  # fmt: skip


def run_stream(url: str, prompt: str) -> tuple[str, dict | None, list]:
    """(text, usage, error events) of one stream."""
    text, usage, errors = "", None, []
    body = dict(BODY, prompt=prompt)
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        if response.status_code != 200:
            return "", None, [response.status_code]
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
                continue
            usage = chunk.get("usage") or usage
            text += "".join(c["text"] for c in chunk["choices"])
    return text, usage, errors


@pytest.mark.parametrize("layout", [["--mixed", "2"], ["--prefill", "1", "--decode", "2"]],
                         ids=["mixed", "disaggregated"])  # fmt: skip
def test_kills_under_load_are_not_seen_by_clients(tiny_model, layout):
    up = Up(tiny_model, *layout, "--worker-restarts", "100", "--stall-timeout", "5")
    try:
        want = {p: run_stream(up.url, p)[:2] for p in PROMPTS}
        stop = threading.Event()
        seen = {"streams": 0, "wrong text or usage": 0, "client-visible errors": 0}
        kills = {"workers killed": 0, "engine cores killed": 0}
        problems: list = []

        def load(index: int) -> None:
            rng = random.Random(index)
            while not stop.is_set():
                prompt = rng.choice(PROMPTS)
                text, usage, errors = run_stream(up.url, prompt)
                seen["streams"] += 1
                if errors:
                    seen["client-visible errors"] += 1
                    problems.append(errors)
                elif (text, usage and usage["completion_tokens"]) != (
                    want[prompt][0],
                    want[prompt][1]["completion_tokens"],
                ):
                    seen["wrong text or usage"] += 1

        def kill() -> None:
            rng = random.Random(0)
            while not stop.wait(KILL_EVERY_S):
                workers = up.load()["workers"]
                if not all(w["healthy"] for w in workers):
                    continue  # only while the cluster could serve everything
                url = rng.choice(workers)["url"]
                pid = pid_serving(url)
                if rng.random() < 0.5:
                    for each in [*child_pids(pid), pid]:
                        os.kill(each, signal.SIGKILL)
                    kills["workers killed"] += 1
                else:
                    os.kill(child_pids(pid)[0], signal.SIGKILL)
                    kills["engine cores killed"] += 1

        loads = [functools.partial(load, i) for i in range(CLIENTS)]
        run_for(CHAOS_SECONDS, stop, *loads, kill)
        decisions = up.load()["decisions"]
        moved = sum(n for k, n in decisions.items() if k.endswith("migrate"))
        resent = sum(n for k, n in decisions.items() if k.endswith("retry"))
        name = f"kills under load {'-'.join(layout).replace('--', '')}"
        report(name, {**seen, **kills, "streams moved": moved, "requests re-sent": resent})
        assert seen["client-visible errors"] == 0, problems[:3]
        assert seen["wrong text or usage"] == 0
        assert kills["workers killed"] + kills["engine cores killed"] >= 5
        deadline = time.monotonic() + 120
        while not all(w["healthy"] for w in up.load()["workers"]):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        up.wait_no_blocks(timeout=60)
    finally:
        up.stop()  # asserts a clean exit and no process left

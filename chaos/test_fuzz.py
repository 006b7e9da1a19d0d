"""Schema fuzzing (schemathesis) of `ember serve`'s OpenAPI schema, against a worker and
against a router in front of two, with bodies the schema allows and bodies it does not:
no answer is a 5xx, every error is an OpenAI error body (Anthropic's on /v1/messages),
and the service is healthy and idle afterwards. (Driven by hand over
`operation.as_strategy`: schemathesis' pytest plugin does not run under pytest 9.)"""

from __future__ import annotations

import contextlib
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from conftest import report
from server_utils import WORKER_ARGS, EmberServer, Up

CASES_PER_OPERATION = 25
SEEN: dict[str, Counter] = {"worker": Counter(), "router": Counter()}


@pytest.fixture(scope="module")
def worker(tiny_model):
    server = EmberServer(tiny_model, *WORKER_ARGS, "--served-model-name", "tiny")
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def cluster(tiny_model):
    up = Up(tiny_model, "--mixed", "2")
    yield up
    up.stop()


def fuzz(target: str, schema_url: str, base_url: str) -> None:
    """Every operation of the schema, CASES_PER_OPERATION cases each (derandomized)."""
    schema = schemathesis.openapi.from_url(schema_url)
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in schemathesis.GenerationMode:  # bodies the schema allows, and not

            @settings(max_examples=CASES_PER_OPERATION, deadline=None, derandomize=True,
                      suppress_health_check=list(HealthCheck), database=None)  # fmt: skip
            @given(case=operation.as_strategy(mode))
            def run(case):
                check(target, case.call(base_url=base_url, timeout=120))

            with contextlib.suppress(Unsatisfiable):  # nothing invalid to send (GET /health)
                run()


def check(target: str, response) -> None:
    SEEN[target]["cases"] += 1
    SEEN[target][f"{response.status_code // 100}xx"] += 1
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400 and response.request.method != "HEAD":
        body = response.json()
        if body.get("type") == "error":  # Anthropic's shape, on /v1/messages
            assert {"type", "message"} <= body["error"].keys()
        else:
            assert {"message", "type", "param", "code"} <= body["error"].keys(), body


def test_the_worker_and_the_router(worker, cluster):
    schema_url = f"{worker.url}/openapi.json"  # the router serves the same API
    fuzz("worker", schema_url, worker.url)
    fuzz("router", schema_url, cluster.url)
    for url in (worker.url, cluster.url):
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    assert worker.wait_idle()["kv_blocks_used"] == 0
    cluster.wait_no_blocks()
    for target, seen in SEEN.items():
        report(f"fuzz {target}", dict(sorted(seen.items())))

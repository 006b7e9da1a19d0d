"""Live stream migration: a stream whose worker fails goes on from another worker.

The worker's half first (the token trail, `resume_params`): a stream cut after any of its
events and resumed on a worker from the trail so far reads, to its client, exactly as the
undisturbed stream. Then the router's half on real clusters: a worker killed (SIGKILL)
or stopped (SIGSTOP) mid-stream, the client's stream going on from another worker.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import threading
import time

import httpx
import pytest

from ember import cluster
from server_utils import WORKER_ARGS, EmberServer, Up, child_pids, pid_serving

SECRET = "migration-test-secret"
ROUTER = {"x-ember-router-token": cluster.router_token(SECRET.encode())}
TRAIL = {**ROUTER, "x-ember-stream-tokens": "1"}
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def worker(tiny_checkpoint):
    """A cluster worker (it has the secret: it serves the router's token alone)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EMBER_CLUSTER_SECRET", SECRET)
        server = EmberServer(str(tiny_checkpoint("llama")), *WORKER_ARGS)
    yield server
    server.stop()


def events_of(url: str, path: str, body: dict, headers: dict) -> list[tuple[list[int], bytes]]:
    """A stream's events, each as (its token trail, its data line)."""
    out = []
    with httpx.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        raw = response.read()
    for event in raw.split(b"\n\n"):
        if not event:
            continue
        trail: list[int] = []
        if event.startswith(b": tokens "):
            line, _, event = event.partition(b"\n")
            trail = [int(t) for t in line[len(b": tokens ") :].split(b",")]
        assert event.startswith(b"data: "), event
        out.append((trail, event))
    return out


def client_view(events: list[bytes]) -> dict:
    """What a client reads from a stream's data lines: ids, text, finish, usage, logprobs."""
    view = {"ids": set(), "created": set(), "text": "", "finish": [], "usage": None,
            "logprobs": [], "roles": 0, "done": 0}  # fmt: skip
    for event in events:
        data = event[len(b"data: ") :]
        if data == b"[DONE]":
            view["done"] += 1
            continue
        chunk = json.loads(data)
        assert "error" not in chunk, chunk
        view["ids"].add(chunk["id"])
        view["created"].add(chunk["created"])
        view["usage"] = chunk.get("usage") or view["usage"]
        for choice in chunk["choices"]:
            delta = choice.get("delta") or {}
            view["roles"] += "role" in delta
            view["text"] += choice.get("text") or delta.get("content") or ""
            if choice.get("finish_reason"):
                view["finish"].append(choice["finish_reason"])
            logprobs = choice.get("logprobs") or {}
            view["logprobs"] += logprobs.get("token_logprobs") or [
                e["logprob"] for e in logprobs.get("content") or []
            ]
    return view


STREAMS = [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "logprobs": 1}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 40, "temperature": 1.0, "seed": 7,
                         "stop": ["ab", "e t"], "echo": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": 40, "temperature": 0.8, "seed": 11,
                              "frequency_penalty": 0.5, "logprobs": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}],
                              "max_tokens": 40, "temperature": 0, "min_tokens": 30,
                              "stream_options": {"include_usage": True,
                                                 "continuous_usage_stats": True}}),
]  # fmt: skip


@pytest.mark.parametrize("path,body", STREAMS)
def test_a_stream_resumed_from_any_event_reads_as_the_undisturbed_one(worker, path, body):
    body = dict(body, stream=True)
    body.setdefault("stream_options", {"include_usage": True})
    events = events_of(worker.url, path, body, TRAIL)
    whole = client_view([e for _, e in events])
    assert whole["done"] == 1 and whole["finish"] and whole["usage"]
    trail = [t for ids, _ in events for t in ids]
    assert len(trail) == whole["usage"]["completion_tokens"]  # every token, once
    plain = events_of(worker.url, path, body, ROUTER)  # no trail asked: the same stream
    assert client_view([e for _, e in plain])["text"] == whole["text"]

    first = json.loads(events[0][1][len(b"data: ") :])
    finish = next(i for i, (_, e) in enumerate(events) if b'"finish_reason":"' in e)
    for cut in sorted({1, 2, 3, finish // 2, finish - 1, finish} & set(range(1, finish + 1))):
        sent = [t for ids, _ in events[:cut] for t in ids]
        resume = {"token_ids": sent, "id": first["id"], "created": first["created"]}
        rest = events_of(worker.url, path, dict(body, resume_params=resume), TRAIL)
        assert [t for ids, _ in rest for t in ids] == trail[len(sent) :]
        spliced = client_view([e for _, e in events[:cut]] + [e for _, e in rest])
        # the new worker's prefix-cache hit, of prompt tokens; logprobs of its prefill
        hit = spliced["usage"]["prompt_tokens_details"].pop("cached_tokens")
        assert 0 <= hit <= spliced["usage"]["prompt_tokens"]
        whole["usage"]["prompt_tokens_details"].pop("cached_tokens", None)
        assert spliced.pop("logprobs") == pytest.approx(whole["logprobs"], abs=1e-4)
        assert spliced == {k: v for k, v in whole.items() if k != "logprobs"}, cut
    assert worker.wait_idle()["kv_blocks_used"] == 0


def test_resume_params_are_the_routers_alone_and_checked(worker, tiny_checkpoint):
    body = {"prompt": PROMPT, "max_tokens": 8, "stream": True}
    good = {"token_ids": [5, 6], "id": "cmpl-1", "created": 1}

    def refused(resume, headers=ROUTER, url=worker.url, **extra) -> str:
        response = httpx.post(f"{url}/v1/completions", headers=headers, timeout=30,
                              json=dict(body, resume_params=resume, **extra))  # fmt: skip
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "resume_params"
        return error["message"]

    assert "max_tokens" in refused(dict(good, token_ids=list(range(9))))
    # all 8 resumed (its worker failed before its finish_reason went out): just that is due
    ended = events_of(
        worker.url,
        "/v1/completions",
        dict(body, resume_params=dict(good, token_ids=list(range(8)))),
        TRAIL,
    )
    view = client_view([e for _, e in ended])
    assert (view["text"], view["finish"], view["ids"]) == ("", ["length"], {"cmpl-1"})
    assert [ids for ids, _ in ended] == [[], []]  # the router knows those tokens already
    assert "[0, " in refused(dict(good, token_ids=[10**6]))
    assert "id" in refused(dict(good, id="x\ny"))
    assert refused(dict(good, extra=1))
    assert refused([1, 2])
    assert "stream" in refused(good, stream=False)
    assert "n = 1" in refused(good, n=2)
    response = httpx.post(f"{worker.url}/v1/completions", json=dict(body, resume_params=good))
    assert response.status_code == 401  # a client cannot reach a cluster worker at all
    standalone = EmberServer(str(tiny_checkpoint("llama")), *WORKER_ARGS)
    try:  # a worker without the secret takes it from no one
        assert "EMBER_CLUSTER_SECRET" in refused(good, headers={}, url=standalone.url)
    finally:
        standalone.stop()


# -- the router moving streams of real clusters --------------------------------------------

LONG_STREAM = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True,
               "temperature": 0, "stream_options": {"include_usage": True}}  # fmt: skip


def read_stream(url: str, body: dict, after=None, num_events: int = 4):
    """(client view, the worker that began it) of a stream through the router; `after(worker
    url)` runs once `num_events` events have come."""
    events, worker = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        worker = response.headers["x-ember-worker"]
        for line in response.iter_lines():
            assert not line.startswith(":"), line  # the token trail stays in the cluster
            if line.startswith("data: "):
                events.append(line.encode())
                if len(events) == num_events and after is not None:
                    after(worker)
    return client_view(events), worker


def assert_same_stream(got: dict, want: dict) -> None:
    """The same tokens' text, finish and usage, under one id (each stream its own)."""
    got, want = copy.deepcopy(got), copy.deepcopy(want)
    for view in (got, want):
        view["usage"]["prompt_tokens_details"].pop("cached_tokens")  # the worker's own hit
        assert len(view.pop("ids")) == len(view.pop("created")) == 1
    assert got == want


def signal_worker(url: str, sig: int) -> None:
    """`sig` to a worker's API process and its engine core."""
    pid = pid_serving(url)
    for each in [*child_pids(pid), pid]:
        os.kill(each, sig)


@pytest.fixture(scope="module")
def mixed(tiny_checkpoint):
    cluster = Up(str(tiny_checkpoint("llama")), "--mixed", "2", "--stall-timeout", "2")
    yield cluster
    cluster.stop()


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 5}])
def test_a_stream_whose_worker_is_killed_goes_on_from_another(mixed, sampling):
    body = dict(LONG_STREAM, **sampling)
    want, _ = read_stream(mixed.url, body)
    got, first = read_stream(mixed.url, body, lambda url: signal_worker(url, signal.SIGKILL))
    assert_same_stream(got, want)  # no token lost, repeated or changed; one usage, one id
    assert mixed.load()["decisions"]["migrate"] >= 1
    wait_healthy(mixed, first)  # ember up restarts it
    mixed.wait_no_blocks()


def test_a_stream_whose_worker_stalls_or_whose_engine_dies_moves(mixed):
    want, _ = read_stream(mixed.url, LONG_STREAM)
    moves = mixed.load()["decisions"].get("migrate", 0)

    stopped = []
    got, first = read_stream(mixed.url, LONG_STREAM, lambda url: (
        signal_worker(url, signal.SIGSTOP), stopped.append(url)))  # fmt: skip
    signal_worker(stopped[0], signal.SIGCONT)  # moved after --stall-timeout 2: wake it
    assert_same_stream(got, want)
    assert mixed.load()["decisions"]["migrate"] == moves + 1
    mixed.wait_no_blocks()  # the stalled worker aborted its copy once it woke
    wait_healthy(mixed, stopped[0])  # (its health checks failed while it was stopped)

    def kill_engine(url):  # its API process stays, and ends the stream with an error event
        os.kill(child_pids(pid_serving(url))[0], signal.SIGKILL)

    got, first = read_stream(mixed.url, LONG_STREAM, kill_engine)
    assert_same_stream(got, want)
    assert mixed.load()["decisions"]["migrate"] == moves + 2
    wait_healthy(mixed, first)  # its API process restarted the engine; the router re-admits it
    assert mixed.worker_load(first)["engine_restarts"] == 1
    mixed.wait_no_blocks()


def wait_healthy(cluster, url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                worker = next(w for w in cluster.load()["workers"] if w["url"] == url)
                if worker["healthy"]:
                    return
        time.sleep(0.2)
    raise AssertionError(f"{url} did not come back")


def test_a_disaggregated_stream_moves_when_its_decode_worker_dies(tiny_checkpoint):
    cluster = Up(str(tiny_checkpoint("llama")), "--prefill", "1", "--decode", "2")
    try:
        want, _ = read_stream(cluster.url, LONG_STREAM)
        got, first = read_stream(
            cluster.url, LONG_STREAM, lambda u: signal_worker(u, signal.SIGKILL)
        )
        assert first in cluster.urls("decode")
        assert_same_stream(got, want)
        decisions = cluster.load()["decisions"]
        assert sum(n for k, n in decisions.items() if k.endswith(":migrate")) == 1
        wait_healthy(cluster, first)
        cluster.wait_no_blocks()
    finally:
        cluster.stop()


def test_without_moves_left_a_killed_stream_ends_with_an_error(tiny_checkpoint):
    cluster = Up(str(tiny_checkpoint("llama")), "--mixed", "2", "--max-migrations", "0")
    try:
        got = []
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=LONG_STREAM,
                          timeout=120) as response:  # fmt: skip
            for line in filter(None, response.iter_lines()):
                got.append(line)
                if len(got) == 4:
                    signal_worker(response.headers["x-ember-worker"], signal.SIGKILL)
        errors = [json.loads(x[6:])["error"] for x in got if x.startswith('data: {"error"')]
        assert [e["code"] for e in errors] == ["worker_failed"] and got[-1] == "data: [DONE]"
    finally:
        cluster.stop()


@pytest.mark.parametrize("killed", ["worker", "engine core"])
def test_a_prefill_worker_killed_mid_prefill_costs_the_client_nothing(tiny_checkpoint, killed):
    """Its engine frozen with the prefill in it, the prefill worker (or only its engine
    core, whose API process then ends the prefill with an engine_stopped event) is
    killed: the router sends the request on (no other prefill worker: whole, to the
    decode worker), and the client's stream is the undisturbed one."""
    cluster = Up(str(tiny_checkpoint("llama")), "--prefill", "1", "--decode", "1",
                 "--worker-restarts", "0")  # fmt: skip
    try:
        want, _ = read_stream(cluster.url, LONG_STREAM)
        (prefill,) = cluster.urls("prefill")
        pid = pid_serving(prefill)
        (core,) = child_pids(pid)
        os.kill(core, signal.SIGSTOP)  # the next prefill waits in its engine
        result = {}
        reader = threading.Thread(target=lambda: result.update(
            view=read_stream(cluster.url, LONG_STREAM)))  # fmt: skip
        reader.start()
        deadline = time.monotonic() + 30
        while not cluster.worker_load(prefill)["num_waiting"]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for each in (core, pid) if killed == "worker" else (core,):
            os.kill(each, signal.SIGKILL)
        reader.join(timeout=60)
        got, worker = result["view"]
        assert worker in cluster.urls("decode")
        assert_same_stream(got, want)
        if killed == "worker":
            del cluster.workers[prefill]
        else:
            wait_healthy(cluster, prefill)  # its engine restarted
        cluster.wait_no_blocks()
    finally:
        cluster.stop()

"""The router: placement decisions on their own, then `ember router` in front of two real
`ember serve` workers (affinity, cache hits, failover, 503 when none is left)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from ember.router.policy import Router
from server_utils import EmberServer, free_port

SYSTEM = "You are a careful assistant. " * 20  # a prompt prefix every session shares


def served(router: Router, text: str, session: str | None = None, max_tokens: int = 16):
    decision = router.choose(text, max_tokens, session)
    router.start(decision)
    router.finish(decision)
    return decision


def test_a_session_stays_home_and_sessions_spread():
    router = Router(["http://a", "http://b"])
    homes = {}
    for session in (f"s{i}" for i in range(16)):
        decisions = [served(router, SYSTEM + f"turn {t}", session) for t in range(3)]
        assert len({d.worker.url for d in decisions}) == 1
        assert all(d.reason == "affinity" for d in decisions)
        homes[session] = decisions[0].worker.url
    assert set(homes.values()) == {"http://a", "http://b"}


def test_an_overloaded_home_spills_to_the_next_worker():
    router = Router(["http://a", "http://b"])
    home = served(router, "hello", "session-1").worker
    home.tokens_in_flight = 100_000  # busy with other work
    decision = router.choose("hello again", 16, "session-1")
    assert decision.reason == "spill" and decision.worker is not home


def test_longest_prefix_wins_but_a_shared_system_prompt_decides_nothing():
    router = Router(["http://a", "http://b"])
    first = served(router, SYSTEM + "conversation one " * 10)
    again = router.choose(SYSTEM + "conversation one " * 10 + "and more", 16)
    assert again.reason == "prefix" and again.worker is first.worker
    other = next(w for w in router.workers if w is not first.worker)
    other.remember(router.choose(SYSTEM, 16).hashes)  # now both hold the system prompt
    first.worker.tokens_in_flight = 500
    fresh = router.choose(SYSTEM + "a brand new conversation", 16)
    assert fresh.reason == "least-load" and fresh.worker is other


def test_least_load_counts_tokens_not_requests_and_skips_the_unhealthy():
    router = Router(["http://a", "http://b", "http://c"])
    a, b, c = router.workers
    a.tokens_in_flight, a.requests_in_flight = 5_000, 1  # one long prompt
    b.tokens_in_flight, b.requests_in_flight = 300, 3  # three short ones
    c.healthy = False
    decision = router.choose("x" * 400, 16)
    assert decision.worker is b and decision.reason == "least-load"
    b.reported = {"num_queued_prefill_tokens": 9_000}  # work from elsewhere, seen on /load
    assert router.choose("x" * 400, 16).worker is a
    b.healthy = a.healthy = False
    assert router.choose("x", 16) is None


def test_a_busy_worker_is_not_taken_for_dead():
    """Health checks: a worker that cannot be reached, or says its engine is gone, is down
    at once; one too busy to answer the check in time, or refusing it at its connection
    limit, is down only after HEALTH_MISSES such checks in a row (overload must not empty
    the pools), and up again with its next answer."""
    import asyncio
    import json

    from ember.router.policy import Pools
    from ember.router.state import HEALTH_MISSES, RouterState

    names = ["fine", "slow", "busy", "gone", "restarting"]
    state = RouterState(Pools(Router([f"http://{n}" for n in names])), health_interval=1.0)
    busy_body = json.dumps({"error": {"message": "too many connections", "type": "x",
                                      "param": None, "code": "too_many_connections"}})  # fmt: skip
    answers = {"slow": True, "busy": True}  # while True they answer late, or refuse

    def handler(request: httpx.Request) -> httpx.Response:
        name = request.url.host
        if name == "slow" and answers["slow"]:
            raise httpx.ReadTimeout("too late", request=request)
        if name == "busy" and answers["busy"]:
            return httpx.Response(503, content=busy_body)
        if name == "gone":
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json={"healthy": name != "restarting"})

    async def checks() -> list[dict[str, bool]]:
        state.health_client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        seen = []
        for i in range(HEALTH_MISSES + 1):
            if i == HEALTH_MISSES:
                answers.update(slow=False, busy=False)
            await state.check_health()
            seen.append(
                {w.url.removeprefix("http://"): w.healthy for w in state.fleet.workers.values()}
            )
        await state.health_client.aclose()
        await state.client.aclose()
        return seen

    seen = asyncio.run(checks())
    up = {"fine": True, "slow": True, "busy": True, "gone": False, "restarting": False}
    assert seen[: HEALTH_MISSES - 1] == [up] * (HEALTH_MISSES - 1)
    assert seen[HEALTH_MISSES - 1] == dict(up, slow=False, busy=False)  # missed too many
    assert seen[HEALTH_MISSES] == up  # and back with their next answer


def test_comparison_policies_ignore_sessions_and_prefixes():
    rr = Router(["http://a", "http://b"], policy="round-robin")
    urls = [served(rr, SYSTEM, "same-session").worker.url for _ in range(4)]
    assert urls in (["http://b", "http://a"] * 2, ["http://a", "http://b"] * 2)
    ll = Router(["http://a", "http://b"], policy="least-load")
    ll.workers[0].tokens_in_flight = 50
    assert all(ll.choose(SYSTEM, 16, "s").reason == "least-load" for _ in range(3))
    assert ll.choose(SYSTEM, 16, "s").worker is ll.workers[1]
    with pytest.raises(ValueError, match="policy"):
        Router(["http://a"], policy="random")


# -- `ember router` in front of real workers ----------------------------------------------


@pytest.fixture
def cluster(tiny_checkpoint):
    args = ["--kv-cache-memory", "16M", "--max-model-len", "512"]
    workers = [EmberServer(str(tiny_checkpoint("llama")), *args) for _ in range(2)]
    port = free_port()
    env = dict(os.environ, EMBER_LOG_LEVEL="WARNING")
    router = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "router", "--port", str(port),
         "--health-interval", "0.2", *[a for w in workers for a in ("--mixed", w.url)]],
        env=env,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.2)
    yield url, workers
    router.send_signal(signal.SIGTERM)
    router.wait(30)
    for worker in workers:
        worker.stop()


def chat(url: str, session: str, turn: int) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": SYSTEM + f" turn {turn}"}], "max_tokens": 4}
    return httpx.post(f"{url}/v1/chat/completions", json=body,
                      headers={"x-session-affinity": session}, timeout=60)  # fmt: skip


def test_router_keeps_sessions_home_and_survives_a_dead_worker(cluster):
    url, workers = cluster
    by_session = {}
    for session in ("alpha", "beta", "gamma", "delta"):
        responses = [chat(url, session, t) for t in range(3)]
        assert all(r.status_code == 200 for r in responses)
        assert len({r.headers["x-ember-worker"] for r in responses}) == 1
        assert all(r.headers["x-session-affinity"] == session for r in responses)
        assert responses[2].json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        by_session[session] = responses[0].headers["x-ember-worker"]
    load = httpx.get(f"{url}/load").json()
    assert load["decisions"]["affinity"] == 12 and load["cache_hit_ratio"] > 0

    dead = workers[0]
    os.kill(dead.core_pid, signal.SIGKILL)  # its API still answers, with 503s
    for session in by_session:  # sessions homed on the dead worker move, none fails
        response = chat(url, session, 8)
        assert response.status_code == 200, (response.text, response.headers)
        assert response.headers["x-ember-worker"] == workers[1].url
    os.kill(dead.process.pid, signal.SIGKILL)  # now gone altogether
    for session in by_session:
        response = chat(url, session, 9)
        assert response.status_code == 200
        assert response.headers["x-ember-worker"] == workers[1].url

    workers[1].stop()
    deadline = time.monotonic() + 10
    while httpx.get(f"{url}/health").status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.1)
    response = chat(url, "alpha", 10)
    assert response.status_code == 503
    assert "no healthy worker" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--no-prefix-caching", "--no-gguf-blocks", "--kv-checksum"],
        ["--dtype", "bfloat16", "--max-num-batched-tokens", "256", "--kv-cache-memory", "64M"],
        ["--speculative-method", "ngram", "--num-speculative-tokens", "6",
         "--no-speculative-adaptive", "--prompt-lookup-min", "1", "--prompt-lookup-max", "3",
         "--speculative-disable-by-batch-size", "4"],
    ],
)  # fmt: skip
def test_ember_up_hands_each_engine_option_to_its_workers(flags):
    """Every engine option of `ember up` (on or off, default or not) reaches `ember serve`."""
    from ember.cli import build_parser
    from ember.engine_args import engine_options
    from ember.router.up import worker_flags

    parser = build_parser()
    options = engine_options(parser.parse_args(["up", "m", *flags]))
    passed = engine_options(parser.parse_args(["serve", "m", *worker_flags(options)]))
    assert {k: v for k, v in passed.items() if k != "kv_role"} == {
        k: v for k, v in options.items() if k != "kv_role"
    }


def test_ember_up_starts_a_cluster_and_stops_it_all(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    port, worker_port = free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "up", path, "--mixed", "2", "--port", str(port),
         "--worker-port", str(worker_port), "--kv-cache-memory", "16M", "--max-model-len", "512"],
        stdout=subprocess.PIPE, text=True, env=dict(os.environ, EMBER_LOG_LEVEL="WARNING"),
    )  # fmt: skip
    try:
        line = up.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line
        assert httpx.get(f"http://127.0.0.1:{port}/health").json()["workers"] == 2
        assert chat(f"http://127.0.0.1:{port}", "s", 0).status_code == 200
    finally:
        up.send_signal(signal.SIGTERM)
        assert up.wait(60) == 0
    assert not child_processes_naming(path)


def child_processes_naming(needle: str) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    if needle.encode() in f.read():
                        pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def test_a_shared_store_makes_a_moved_session_cheaper_than_a_recompute():
    """Workers that report the same kv_store: a prompt computed on one costs the other
    STORE_HIT_COST of a recompute for the stored part (more than a local hit)."""
    from ember.router.policy import STORE_HIT_COST

    text = SYSTEM + "a long agent conversation " * 40
    turn2 = text + "and the next turn"
    for shared in (False, True):
        router = Router(["http://a", "http://b"])
        for worker in router.workers:
            worker.reported = {"kv_store": "mooncake://10.0.0.1:50051"} if shared else {}
        home = served(router, text, "s1").worker
        other = next(w for w in router.workers if w is not home)
        home.tokens_in_flight = 100_000  # the home is busy: the session spills
        decision = router.choose(turn2, 16, "s1")
        assert decision.reason == "spill" and decision.worker is other
        prompt = len(turn2) // 4 + 1
        if shared:
            loaded = len(text) // 64 * 64 // 4
            assert decision.cost == prompt - loaded + round(loaded * STORE_HIT_COST) + 16
        else:
            assert decision.cost == prompt + 16
        home.tokens_in_flight = 0
        assert router.choose(turn2, 16, "s1").cost < decision.cost  # a local hit: cheaper


def test_ember_bench_records_the_worker_the_router_chose(cluster, tiny_checkpoint, tmp_path):
    import json

    from ember.cli import build_parser

    url, workers = cluster
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--url", url, "--tokenizer", str(tiny_checkpoint("llama")),
            "--no-progress", "--out", str(out), "--workload", "agentic", "--num-sessions", "4",
            "--num-turns", "2", "--system-tokens", "16", "--num-tools", "0",
            "--turn-tokens", "4", "--output-len", "4"]  # fmt: skip
    parsed = build_parser().parse_args(argv)
    assert parsed.func(parsed) == 0
    records = json.loads(out.read_text())["requests"]
    assert len(records) == 8 and {r["worker"] for r in records} <= {w.url for w in workers}
    for session in {r["session_id"] for r in records}:  # each session stayed home
        assert len({r["worker"] for r in records if r["session_id"] == session}) == 1


def test_bodies_that_are_not_json_are_400s_at_the_router(cluster):
    """Found by `make chaos`: a body that is not UTF-8 was a 500 at the router."""
    url, _ = cluster
    for body in (b"\xff\xfe", b"[" * 100_000 + b"]" * 100_000, b'{"prompt": NaN', b""):
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
            response = httpx.post(f"{url}{path}", content=body, timeout=30,
                                  headers={"content-type": "application/json"})  # fmt: skip
            assert response.status_code == 400, (path, body[:8], response.text)
    assert httpx.get(f"{url}/health").status_code == 200


@pytest.mark.parametrize(
    "body",
    [
        {"messages": True}, {"messages": 5}, {"messages": None}, {"messages": "hi"},
        {"messages": {"role": "user"}}, {"system": ["x"], "messages": False},
        {"prompt": "hi", "max_tokens": float("inf")}, {"prompt": "hi", "max_tokens": -1e400},
    ],
)  # fmt: skip
def test_bodies_of_the_wrong_shape_are_the_workers_400s_at_the_router(cluster, body):
    """Found by `make chaos`: `messages` not a list, or `max_tokens` Infinity (which Python's
    JSON reads), was a 500 at the router, which reads both to place the request."""
    import json

    url, _ = cluster
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/messages"):
        response = httpx.post(f"{url}{path}", content=json.dumps(body), timeout=30,
                              headers={"content-type": "application/json"})  # fmt: skip
        assert response.status_code == 400, (path, body, response.text)
        assert "message" in response.json()["error"]
    assert httpx.get(f"{url}/health").status_code == 200

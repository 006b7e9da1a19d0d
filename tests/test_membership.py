"""Dynamic membership in the router (`ember/router/members.py`): workers that join and
leave while it serves (static flags, DNS discovery, registration), one pool per model,
draining. The router runs in-process here with mock workers; `test_fleet.py` runs real
ones."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from ember import cluster
from ember.headers import MEMBER_TOKEN_HEADER
from ember.router.app import build_router_app
from ember.router.members import DnsTarget, Fleet, check_url
from ember.router.policy import Pools, Router, Worker

SECRET = b"membership-test"
TOKEN = {MEMBER_TOKEN_HEADER: cluster.member_token(SECRET)}


def test_worker_urls_and_discovery_targets_are_checked():
    assert check_url("http://10.0.0.7:8100/") == "http://10.0.0.7:8100"
    assert check_url("https://[fd00::1]:443") == "https://[fd00::1]:443"
    for bad in ("10.0.0.7:8100", "ftp://h:1", "http://h", "http://h:1/v1", "http://u@h:1",
                "http://h:1?x=1", "http://h:99999", "", None, 7, "http://" + "h" * 3000 + ":1"):  # fmt: skip
        with pytest.raises(ValueError, match="url"):
            check_url(bad)
    target = DnsTarget.parse("dns://ember-decode.ns.svc.cluster.local:8100")
    assert (target.name, target.port) == ("ember-decode.ns.svc.cluster.local", 8100)
    for bad in ("dns://name", "http://name:1", "dns://name:1/x", "dns://name:1?role=x", "name:1"):
        with pytest.raises(ValueError, match="--discover"):
            DnsTarget.parse(bad)


def test_a_joining_worker_moves_only_the_sessions_it_becomes_home_of():
    router = Router([f"http://w{i}:1" for i in range(4)])
    sessions = [f"s{i}" for i in range(400)]
    before = {s: router.choose("x", 1, s).worker.url for s in sessions}
    router.add(Worker("http://w4:1"))
    after = {s: router.choose("x", 1, s).worker.url for s in sessions}
    moved = [s for s in sessions if before[s] != after[s]]
    assert all(after[s] == "http://w4:1" for s in moved)  # to the newcomer, nowhere else
    assert 40 < len(moved) < 160  # about a fifth
    router.remove(router.workers[-1])
    assert {s: router.choose("x", 1, s).worker.url for s in sessions} == before


def test_the_fleet_places_workers_by_model_and_role_and_drains_them():
    fleet = Fleet.of(Pools.from_urls(["http://static:1"]))
    assert fleet.pools_for("anything") is fleet.models[None]  # one pool: every request
    fleet.learn(fleet.workers["http://static:1"], {"model": "llama", "role": "prefill"})
    static = fleet.workers["http://static:1"]
    assert static.kind == "mixed" and static.model == "llama"  # a flag's role stands
    assert list(fleet.models) == ["llama"]

    joined = fleet.add("http://new:1")  # registered, not heard from yet: in no pool
    assert not joined.healthy and fleet.pools_for("llama").workers == [static]
    fleet.learn(joined, {"model": "qwen", "role": "decode"})
    assert joined.kind == "decode" and fleet.model_names() == ["llama", "qwen"]
    assert fleet.pools_for("qwen").decode.workers == [joined]
    assert fleet.pools_for("mistral") is None and fleet.pools_for(None) is None

    joined.requests_in_flight = 1
    fleet.drain(joined, "test")
    assert joined.draining and "http://new:1" in fleet.workers  # still busy
    assert fleet.pools_for("qwen").decode.choose("x", 1) is None  # takes nothing new
    joined.requests_in_flight = 0
    fleet.sweep()
    assert "http://new:1" not in fleet.workers and fleet.model_names() == ["llama"]


def test_discovery_adds_new_addresses_and_drains_those_gone():
    target = DnsTarget.parse("dns://workers:8100")
    fleet = Fleet()
    fleet.discovered(target, {"http://10.0.0.1:8100", "http://10.0.0.2:8100"})
    assert sorted(fleet.workers) == ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]
    for worker in fleet.workers.values():
        fleet.learn(worker, {"model": "m", "role": "mixed"})
        worker.healthy = True
    fleet.workers["http://10.0.0.1:8100"].requests_in_flight = 2
    fleet.discovered(target, {"http://10.0.0.2:8100", "http://10.0.0.3:8100"})
    assert fleet.workers["http://10.0.0.1:8100"].draining  # gone from DNS, still busy
    assert not fleet.workers["http://10.0.0.3:8100"].draining
    fleet.discovered(target, {"http://10.0.0.1:8100", "http://10.0.0.2:8100"})  # it is back
    assert not fleet.workers["http://10.0.0.1:8100"].draining
    # 10.0.0.3 drained with nothing in flight: forgotten at once
    assert sorted(fleet.workers) == ["http://10.0.0.1:8100", "http://10.0.0.2:8100"]


def test_a_name_that_does_not_resolve_empties_its_pool_but_a_resolver_failure_does_not():
    async def resolve(name: str):
        return await DnsTarget("dns://x", name, 80).resolve()

    assert asyncio.run(resolve("localhost")) >= {"http://127.0.0.1:80"}
    assert asyncio.run(resolve("no-such-worker.invalid")) == set()


# -- the router's /workers routes and per-model pools, with mock workers ----------------


class MockWorkers:
    """Workers answering /load with their model and role, and chat with their own URL."""

    def __init__(self, models: dict[str, str]) -> None:
        self.models = models  # host -> model
        self.down: set[str] = set()

    def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down or host not in self.models:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == "/load":
            if host == "router":  # another router's /load: no role of its own
                return httpx.Response(200, json={"workers": [], "decisions": {}})
            return httpx.Response(200, json={"model": self.models[host], "role": "mixed"})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": self.models[host], "object": "model"}]})  # fmt: skip
        body = json.loads(request.content)
        answer = json.dumps({"worker": host, "model": body.get("model")}).encode()
        return httpx.Response(200, headers={"content-type": "application/json"},
                              stream=httpx.ByteStream(answer))  # fmt: skip


def router_with(workers: MockWorkers, secret: bytes | None = SECRET, static=()):
    app = build_router_app(Pools.from_urls(list(static)), cluster_secret=secret)
    state = app.state.router
    transport = httpx.MockTransport(workers.handler)
    state.client = httpx.AsyncClient(transport=transport)
    state.health_client = httpx.AsyncClient(transport=transport)
    client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://router")
    return state, client


def test_registration_needs_the_member_token_and_a_valid_worker():
    async def run() -> None:
        state, client = router_with(MockWorkers({"a": "m", "router": "m"}))
        post = client.post
        url = {"url": "http://a:1"}
        assert (await post("/workers", json=url)).status_code == 401
        wrong = {MEMBER_TOKEN_HEADER: cluster.member_token(b"other")}
        assert (await post("/workers", json=url, headers=wrong)).status_code == 401
        router_token = {MEMBER_TOKEN_HEADER: cluster.router_token(SECRET)}
        assert (await post("/workers", json=url, headers=router_token)).status_code == 401
        for body, param in (({"url": "http://a"}, "url"), ({"url": "http://a:1", "role": "x"},
                            "role"), ({"url": "http://a:1", "extra": 1}, "extra"),
                            ([1], None), ({}, "url")):  # fmt: skip
            response = await post("/workers", json=body, headers=TOKEN)
            assert response.status_code == 400, body
            assert response.json()["error"]["param"] == param
        response = await post("/workers", content=b"{", headers=TOKEN)
        assert response.status_code == 400
        assert state.fleet.workers == {}
        response = await post("/workers", json=url, headers=TOKEN)
        assert response.status_code == 201
        entry = response.json()
        assert entry["model"] == "m" and entry["status"] == "up" and entry["source"] == "register"
        assert (await post("/workers", json=url, headers=TOKEN)).status_code == 200  # heartbeat
        response = await post("/workers", json={"url": "http://router:1"}, headers=TOKEN)
        assert response.json()["status"] == "down"  # a router is no worker: no loop
        await client.delete(f"/workers/{response.json()['id']}", headers=TOKEN)
        assert (await client.delete(f"/workers/{entry['id']}")).status_code == 401
        assert (await client.delete("/workers/wnope", headers=TOKEN)).status_code == 404
        response = await client.delete(f"/workers/{entry['id']}", headers=TOKEN)
        assert response.status_code == 200 and response.json()["draining"]
        assert (await client.get("/workers")).json() == {"workers": []}  # idle: forgotten

        state, client = router_with(MockWorkers({"a": "m"}), secret=None)
        response = await client.post("/workers", json=url, headers=TOKEN)
        assert response.status_code == 401
        assert "EMBER_CLUSTER_SECRET" in response.json()["error"]["message"]

    asyncio.run(run())


def test_two_models_behind_one_router_each_go_to_their_own_pool():
    async def run() -> None:
        workers = MockWorkers({"a1": "alpha", "a2": "alpha", "b1": "beta"})
        state, client = router_with(workers, static=["http://a1:1"])
        await state.check_health()
        for host in ("a2", "b1"):
            response = await client.post("/workers", json={"url": f"http://{host}:1"},
                                          headers=TOKEN)  # fmt: skip
            assert response.status_code == 201
        assert (await client.get("/health")).json()["models"] == ["alpha", "beta"]
        seen = {"alpha": set(), "beta": set()}
        for i in range(12):
            model = "alpha" if i % 3 else "beta"
            body = {"model": model, "messages": [{"role": "user", "content": f"hi {i}"}]}
            session = {"x-session-affinity": f"session-{i}"}  # spread over the pool's ring
            response = await client.post("/v1/chat/completions", json=body, headers=session)
            assert response.status_code == 200 and response.json()["model"] == model
            seen[model].add(response.json()["worker"])
        assert seen == {"alpha": {"a1", "a2"}, "beta": {"b1"}}
        body = {"model": "gamma", "messages": [{"role": "user", "content": "hi"}]}
        response = await client.post("/v1/chat/completions", json=body)
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert "alpha, beta" in error["message"]
        names = [m["id"] for m in (await client.get("/v1/models")).json()["data"]]
        assert sorted(names) == ["alpha", "beta"]

        workers.down.add("b1")  # beta's only worker fails: beta is 503, alpha unharmed
        await state.check_health()
        body["model"] = "beta"
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 503
        body["model"] = "alpha"
        assert (await client.post("/v1/chat/completions", json=body)).status_code == 200

    asyncio.run(run())

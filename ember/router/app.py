"""The router's HTTP side: the OpenAI API, Anthropic's Messages API (and /tokenize,
/detokenize) in front of worker pools (routes, the client check, the health and discovery
loops' life cycle), and the fleet's own routes: `GET /workers`, `POST /workers` and
`DELETE /workers/{id}` (these two with the cluster's member token). How a request is
placed and relayed is `forward.py`; the router's view of its workers is `state.py` and
`members.py`."""

from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from ember import cluster
from ember.headers import MEMBER_TOKEN_HEADER
from ember.router.forward import client_headers, forward, no_workers, to_any_worker
from ember.router.members import (
    DEFAULT_DISCOVER_INTERVAL_S,
    DnsTarget,
    Fleet,
    check_role,
    check_url,
)
from ember.router.migrate import Migration
from ember.router.policy import Pools, Router, Worker
from ember.router.state import RouterState
from ember.server.errors import MESSAGES_PATH, RESPONSES_PATH, error_body
from ember.server.guard import Access, Guard


def build_router_app(
    pools: Fleet | Pools | Router,
    health_interval: float = 1.0,
    access: Access | None = None,
    cluster_secret: bytes | None = None,
    migration: Migration | None = None,
    discover: tuple[DnsTarget, ...] = (),
    discover_interval: float = DEFAULT_DISCOVER_INTERVAL_S,
) -> FastAPI:
    """`access`: what clients must show (checked here, never by the workers);
    `cluster_secret`: the router's token for its workers, what moving a stream needs,
    and what registering a worker must prove; `migration`: how streams move when their
    worker fails; `discover`: names resolved to workers every `discover_interval` s."""
    if isinstance(pools, Router):
        pools = Pools(mixed=pools)
    state = RouterState(pools, health_interval, cluster_secret, migration or Migration(),
                        discover, discover_interval)  # fmt: skip
    fleet = state.fleet

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.discover_once()
        await state.check_health()
        tasks = [asyncio.create_task(state.health_loop())]
        if discover:
            tasks.append(asyncio.create_task(state.discover_loop()))
        yield
        for task in tasks:
            task.cancel()
        await state.client.aclose()
        await state.health_client.aclose()

    app = FastAPI(title="ember router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = state
    app.add_middleware(Guard, access=access or Access())

    for path in ("/v1/chat/completions", "/v1/completions", MESSAGES_PATH, RESPONSES_PATH):
        app.add_api_route(path, _route(forward, state, path), methods=["POST"])
    for path in ("/tokenize", "/detokenize"):  # any worker answers these alike
        app.add_api_route(path, _route(to_any_worker, state, path), methods=["POST"])

    @app.get(RESPONSES_PATH + "/{response_id}")
    async def stored_response(response_id: str, request: Request):
        """From the worker that stored it (the router learnt where when it passed by)."""
        url = state.response_homes.get(response_id)
        if url is None:
            message = f"no stored response with id {response_id!r}"
            return JSONResponse(error_body(404, message, None, "not_found"), status_code=404)
        headers = {**client_headers(request), **state.worker_headers}
        try:
            response = await state.client.get(f"{url}{RESPONSES_PATH}/{response_id}",
                                              headers=headers, timeout=10.0)  # fmt: skip
        except httpx.HTTPError:
            return no_workers()
        return Response(response.content, response.status_code, media_type="application/json")

    @app.get("/v1/models")
    async def models(request: Request):
        """Every model's list, from one healthy worker of each pool."""
        headers = {**client_headers(request), **state.worker_headers}
        data, answered = [], None
        for pools in list(fleet.models.values()):
            for worker in pools.healthy():
                with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
                    response = await state.client.get(
                        f"{worker.url}/v1/models", headers=headers, timeout=5.0
                    )
                    if response.status_code != 200:
                        answered = answered or response
                        continue
                    data += [m for m in response.json()["data"] if m not in data]
                    break
        if data:
            return {"object": "list", "data": data}
        if answered is not None:  # e.g. the client's key refused by the workers
            return Response(answered.content, answered.status_code,
                            media_type="application/json")  # fmt: skip
        return no_workers()

    @app.get("/health")
    async def health():
        healthy = fleet.healthy()
        if not healthy:
            return no_workers()
        return {"status": "ok", "workers": len(healthy), "models": fleet.model_names()}

    @app.get("/load")
    async def load():
        return {
            "workers": [_entry(w) for w in fleet.workers.values()],
            "models": fleet.model_names(),
            "decisions": dict(state.decisions),
            "cache_hit_ratio": state.cached_tokens / max(state.prompt_tokens, 1),
        }

    @app.get("/workers")
    async def workers():
        return {"workers": [_entry(w) for w in fleet.workers.values()]}

    @app.post("/workers")
    async def add_worker(request: Request):
        """A worker joins: `{"url": "http://HOST:PORT", "role": ROLE?}`. It is checked at
        once; its /load says its model (and role). 201 with the worker as the router sees
        it; again for a worker it has (a heartbeat) 200."""
        if refusal := _not_member(state, request):
            return refusal
        try:
            url, role = _registration(await request.body())
        except _BadField as exc:
            return JSONResponse(error_body(400, str(exc), exc.param), status_code=400)
        known = url in fleet.workers and not fleet.workers[url].draining
        try:
            worker = fleet.add(url, role, "register")
        except ValueError as exc:  # the fleet is full
            return JSONResponse(error_body(400, str(exc), "url"), status_code=400)
        if not known:
            await state.check_worker(worker)
        return JSONResponse(_entry(worker), status_code=200 if known else 201)

    @app.delete("/workers/{worker_id}")
    async def remove_worker(worker_id: str, request: Request):
        """A worker leaves: it drains (no new request) and is forgotten once idle."""
        if refusal := _not_member(state, request):
            return refusal
        worker = fleet.find(worker_id)
        if worker is None:
            message = f"no worker with id {worker_id!r}"
            return JSONResponse(error_body(404, message, None, "not_found"), status_code=404)
        fleet.drain(worker, "removed by DELETE /workers")
        return _entry(worker)

    @app.get("/metrics")
    async def metrics():
        for worker in fleet.workers.values():
            state.worker_load.labels(worker.url, worker.kind).set(worker.tokens_in_flight)
        state.hit_ratio.set(state.cached_tokens / max(state.prompt_tokens, 1))
        state.num_workers.clear()
        for worker in fleet.workers.values():
            state.num_workers.labels(worker.model or "", worker.kind, _status(worker)).inc()
        return Response(generate_latest(state.registry), media_type="text/plain; version=0.0.4")

    return app


def _status(worker: Worker) -> str:
    return "draining" if worker.draining else "up" if worker.healthy else "down"


def _entry(worker: Worker) -> dict:
    return {
        "id": worker.id, "url": worker.url, "pool": worker.kind, "model": worker.model,
        "source": worker.source, "status": _status(worker), "healthy": worker.healthy,
        "draining": worker.draining, "tokens_in_flight": worker.tokens_in_flight,
        "requests_in_flight": worker.requests_in_flight, "reported": worker.reported,
        "prefix_chunks": len(worker.chunks),  # its prefix table (at most 200,000)
    }  # fmt: skip


class _BadField(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def _registration(raw: bytes) -> tuple[str, str | None]:
    """(url, role) of a `POST /workers` body, or a _BadField naming what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise _BadField("malformed JSON body") from None
    if not isinstance(body, dict):
        raise _BadField("the body must be a JSON object")
    if unknown := sorted(set(body) - {"url", "role"}):
        raise _BadField(f"unknown field {unknown[0]!r}: a worker is its url and role", unknown[0])
    for param, check in (("url", check_url), ("role", check_role)):
        try:
            body[param] = check(body.get(param))
        except ValueError as exc:
            raise _BadField(str(exc), param) from None
    return body["url"], body["role"]


def _not_member(state: RouterState, request: Request) -> JSONResponse | None:
    """A 401 unless the request shows the cluster's member token (none is valid when
    the router has no cluster secret)."""
    if cluster.is_member(state.cluster_secret, request.headers.get(MEMBER_TOKEN_HEADER)):
        return None
    if state.cluster_secret is None:
        message = "adding or removing workers needs $EMBER_CLUSTER_SECRET, which this router lacks"
    else:
        message = f"missing or invalid {MEMBER_TOKEN_HEADER}"
    return JSONResponse(error_body(401, message, None, "invalid_member_token"), status_code=401)


def _route(handle, state: RouterState, path: str):
    """The endpoint that hands each request on `path` to `handle` (forward, to_any_worker)."""

    async def endpoint(request: Request):
        return await handle(state, request, path)

    return endpoint

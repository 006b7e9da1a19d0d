"""The router's HTTP side: the OpenAI API, Anthropic's Messages API (and /tokenize,
/detokenize) in front of worker
pools (routes, the client check, the health loop's life cycle). How a request is placed
and relayed is `forward.py`; the router's view of its workers is `state.py`."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import generate_latest

from ember.router.forward import client_headers, forward, no_workers, to_any_worker
from ember.router.migrate import Migration
from ember.router.policy import Pools, Router
from ember.router.state import RouterState
from ember.server.errors import MESSAGES_PATH, RESPONSES_PATH, error_body
from ember.server.guard import Access, Guard


def build_router_app(
    pools: Pools | Router,
    health_interval: float = 1.0,
    access: Access | None = None,
    cluster_secret: bytes | None = None,
    migration: Migration | None = None,
) -> FastAPI:
    """`access`: what clients must show (checked here, never by the workers);
    `cluster_secret`: the router's token for its workers (and what moving a stream
    needs); `migration`: how streams move when their worker fails."""
    if isinstance(pools, Router):
        pools = Pools(mixed=pools)
    state = RouterState(pools, health_interval, cluster_secret, migration or Migration())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.check_health()
        task = asyncio.create_task(state.health_loop())
        yield
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
        headers = {**client_headers(request), **state.worker_headers}
        for worker in pools.healthy():
            with contextlib.suppress(httpx.HTTPError):
                response = await state.client.get(
                    f"{worker.url}/v1/models", headers=headers, timeout=5.0
                )
                return Response(response.content, response.status_code,
                                media_type="application/json")  # fmt: skip
        return no_workers()

    @app.get("/health")
    async def health():
        if not pools.healthy():
            return no_workers()
        return {"status": "ok", "workers": len(pools.healthy())}

    @app.get("/load")
    async def load():
        return {
            "workers": [
                {"url": w.url, "pool": w.kind, "healthy": w.healthy,
                 "tokens_in_flight": w.tokens_in_flight,
                 "requests_in_flight": w.requests_in_flight, "reported": w.reported,
                 "prefix_chunks": len(w.chunks)}  # its prefix table (at most 200,000)
                for w in pools.workers
            ],
            "decisions": dict(state.decisions),
            "cache_hit_ratio": state.cached_tokens / max(state.prompt_tokens, 1),
        }  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        for worker in pools.workers:
            state.worker_load.labels(worker.url, worker.kind).set(worker.tokens_in_flight)
        state.hit_ratio.set(state.cached_tokens / max(state.prompt_tokens, 1))
        return Response(generate_latest(state.registry), media_type="text/plain; version=0.0.4")

    return app


def _route(handle, state: RouterState, path: str):
    """The endpoint that hands each request on `path` to `handle` (forward, to_any_worker)."""

    async def endpoint(request: Request):
        return await handle(state, request, path)

    return endpoint

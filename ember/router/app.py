"""The router's HTTP side: the OpenAI API in front of mixed workers.

Life cycle of a request: read the body, pick a worker (`policy.Router.choose`), forward
the request unchanged (with its x-session-affinity header) and relay the response byte
for byte, streaming or not, with `x-ember-worker` naming the worker. A worker that cannot
be reached, or answers 503 (its engine is gone), leaves the pool and the request is
retried on another (reason "retry"); when no worker is healthy the client gets a 503 saying so. The
usage of every response is read on the way through for the cluster's cache hit ratio.
A health loop polls each worker's /load every `health_interval` seconds: a worker that
fails leaves the pool, one that answers again comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections import Counter

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client import Counter as PromCounter

from ember.router.policy import Decision, Router
from ember.server.errors import error_body

logger = logging.getLogger("ember.router")

SESSION_HEADER = "x-session-affinity"
WORKER_HEADER = "x-ember-worker"


class RouterState:
    def __init__(self, router: Router, health_interval: float) -> None:
        self.router = router
        self.health_interval = health_interval
        self.decisions: Counter = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.registry = CollectorRegistry()
        self.decision_counter = PromCounter(
            "ember_router_decisions", "Routing decisions by reason.", ["reason"],
            registry=self.registry,
        )  # fmt: skip
        self.worker_load = Gauge(
            "ember_router_worker_tokens_in_flight", "Tokens in flight per worker.", ["worker"],
            registry=self.registry,
        )  # fmt: skip
        self.hit_ratio = Gauge(
            "ember_router_cache_hit_ratio", "Cached / prompt tokens over all responses.",
            registry=self.registry,
        )  # fmt: skip

    def record_usage(self, usage: dict | None) -> None:
        if not usage:
            return
        self.prompt_tokens += usage.get("prompt_tokens") or 0
        details = usage.get("prompt_tokens_details") or {}
        self.cached_tokens += details.get("cached_tokens") or 0

    def decide(self, decision: Decision) -> None:
        self.decisions[decision.reason] += 1
        self.decision_counter.labels(decision.reason).inc()

    async def check_health(self) -> None:
        for worker in self.router.workers:
            try:
                response = await self.client.get(f"{worker.url}/load", timeout=2.0)
                ok = response.status_code == 200 and response.json().get("healthy", True)
                worker.reported = response.json() if ok else {}
            except (httpx.HTTPError, ValueError):
                ok = False
            if ok != worker.healthy:
                logger.warning("worker %s is %s", worker.url, "back" if ok else "down")
            worker.healthy = ok

    async def health_loop(self) -> None:
        while True:
            await self.check_health()
            await asyncio.sleep(self.health_interval)


def build_router_app(router: Router, health_interval: float = 1.0) -> FastAPI:
    state = RouterState(router, health_interval)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await state.check_health()
        task = asyncio.create_task(state.health_loop())
        yield
        task.cancel()
        await state.client.aclose()

    app = FastAPI(title="ember router", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.router = state

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await _forward(state, request, "/v1/chat/completions")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _forward(state, request, "/v1/completions")

    @app.get("/v1/models")
    async def models():
        for worker in router.healthy():
            with contextlib.suppress(httpx.HTTPError):
                response = await state.client.get(f"{worker.url}/v1/models", timeout=5.0)
                return Response(response.content, response.status_code,
                                media_type="application/json")  # fmt: skip
        return _no_workers()

    @app.get("/health")
    async def health():
        if not router.healthy():
            return _no_workers()
        return {"status": "ok", "workers": len(router.healthy())}

    @app.get("/load")
    async def load():
        return {
            "workers": [
                {"url": w.url, "healthy": w.healthy, "tokens_in_flight": w.tokens_in_flight,
                 "requests_in_flight": w.requests_in_flight, "reported": w.reported}
                for w in router.workers
            ],
            "decisions": dict(state.decisions),
            "cache_hit_ratio": state.cached_tokens / max(state.prompt_tokens, 1),
        }  # fmt: skip

    @app.get("/metrics")
    async def metrics():
        for worker in router.workers:
            state.worker_load.labels(worker.url).set(worker.tokens_in_flight)
        state.hit_ratio.set(state.cached_tokens / max(state.prompt_tokens, 1))
        return Response(generate_latest(state.registry), media_type="text/plain; version=0.0.4")

    return app


def _no_workers() -> JSONResponse:
    body = error_body(503, "no healthy worker: every worker of this router is down")
    return JSONResponse(body, status_code=503)


def _prompt_text(body: dict) -> str:
    """The text the prompt is made of, for prefix matching (messages in order)."""
    if "messages" in body:
        return "".join(f"{m.get('role')}:{json.dumps(m.get('content'))}\n"
                       for m in body["messages"] if isinstance(m, dict))  # fmt: skip
    return json.dumps(body.get("prompt"))


async def _forward(state: RouterState, request: Request, path: str):
    raw = await request.body()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        return JSONResponse(error_body(400, "malformed JSON body"), status_code=400)
    if not isinstance(body, dict):
        return JSONResponse(error_body(400, "the body must be a JSON object"), status_code=400)
    session_id = request.headers.get(SESSION_HEADER)
    headers = {k: v for k, v in request.headers.items()
               if k.lower() in ("authorization", SESSION_HEADER, "content-type")}  # fmt: skip
    text = _prompt_text(body)
    try:
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 256)
    except (TypeError, ValueError):
        max_tokens = 256  # the worker will answer the bad value with a 400
    tried: set[str] = set()
    while True:
        decision = state.router.choose(text, max_tokens, session_id, tried)
        if decision is None:
            return _no_workers()
        if tried:
            decision = Decision(decision.worker, "retry", decision.cost, decision.hashes)
        state.decide(decision)
        state.router.start(decision)
        try:
            upstream = await _open(state, decision, path, raw, headers)
        except httpx.TransportError as exc:
            upstream, why = None, f"unreachable ({exc})"
        else:
            why = "unavailable (503)" if upstream.status_code == 503 else None
        if why is None:
            return _relay(state, decision, upstream, session_id)
        if upstream is not None:  # its engine is gone; nothing was started there
            await upstream.aclose()
        state.router.finish(decision)
        logger.warning("worker %s %s; retrying elsewhere", decision.worker.url, why)
        decision.worker.healthy = False
        tried.add(decision.worker.url)


async def _open(state: RouterState, decision: Decision, path: str, raw: bytes, headers: dict):
    request = state.client.build_request(
        "POST", f"{decision.worker.url}{path}", content=raw, headers=headers
    )
    return await state.client.send(request, stream=True)


def _relay(state: RouterState, decision: Decision, upstream: httpx.Response, session_id):
    headers = {WORKER_HEADER: decision.worker.url}
    if session_id:
        headers[SESSION_HEADER] = session_id
    media_type = upstream.headers.get("content-type", "application/json")

    keep = 4096 if "event-stream" in media_type else 1 << 20  # SSE: its last chunk suffices

    async def body():
        tail = b""
        try:
            async for chunk in upstream.aiter_raw():
                tail = (tail + chunk)[-keep:]
                yield chunk
        finally:
            await upstream.aclose()
            state.router.finish(decision)
            state.record_usage(_usage(tail))

    return StreamingResponse(body(), upstream.status_code, headers=headers, media_type=media_type)


def _usage(tail: bytes) -> dict | None:
    """The usage block of a response, from its last bytes (JSON body or final SSE chunk)."""
    text = tail.decode(errors="ignore")
    for candidate in reversed(text.replace("data: ", "\n").splitlines()):
        candidate = candidate.strip()
        if '"usage"' in candidate and candidate.startswith("{"):
            with contextlib.suppress(ValueError):
                return json.loads(candidate).get("usage")
    return None

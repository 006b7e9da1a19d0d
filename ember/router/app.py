"""The router's HTTP side: the OpenAI API in front of worker pools.

A whole request (mixed workers): read the body, pick a worker (`policy.Router.choose`),
forward the request unchanged (with its x-session-affinity header) and relay the
response byte for byte, streaming or not, with `x-ember-worker` naming the worker.

A disaggregated request (prefill and decode pools, n = 1, one prompt):
    1. pick a prefill worker (cost: prompt tokens it does not hold) and send it the
       request with `kv_transfer_params: {"do_remote_decode": true}`; it computes the
       prompt's KV and the first token, holds the blocks and answers where they wait;
       if it finished right there (EOS, a stop string, max_tokens 1) that answer is the
       response;
    2. pick a decode worker (load: the KV it holds) and send it the request with the
       prefill's `kv_transfer_params`; it fetches the blocks it lacks, emits the first
       token at once and generates the rest. Its response, relayed byte for byte, is
       the client's one ordinary response or SSE stream, its usage carrying the prefill
       worker's cached_tokens. `x-ember-prefill-worker` names the prefill worker.
With no healthy decode worker the prefill worker decodes too; with no healthy prefill
worker the request runs whole on a decode (or mixed) worker.

A worker that cannot be reached, or answers 503 (its engine is gone), leaves its pool
and the request is retried on another (reason "retry"); when no worker is healthy the
client gets a 503 saying so. The usage of every response is read on the way through for
the cluster's cache hit ratio. A health loop polls each worker's /load every
`health_interval` seconds: a worker that fails leaves its pool, one that answers again
comes back.
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

from ember.router.policy import Decision, Pools, Router, Worker
from ember.server.errors import error_body

logger = logging.getLogger("ember.router")

SESSION_HEADER = "x-session-affinity"
WORKER_HEADER = "x-ember-worker"
PREFILL_HEADER = "x-ember-prefill-worker"


class RouterState:
    def __init__(self, pools: Pools, health_interval: float) -> None:
        self.pools = pools
        self.health_interval = health_interval
        self.decisions: Counter = Counter()
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))
        self.registry = CollectorRegistry()
        self.decision_counter = PromCounter(
            "ember_router_decisions", "Routing decisions by pool and reason.",
            ["pool", "reason"], registry=self.registry,
        )  # fmt: skip
        self.worker_load = Gauge(
            "ember_router_worker_tokens_in_flight", "Tokens in flight per worker.",
            ["worker", "pool"], registry=self.registry,
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

    def decide(self, decision: Decision, pool: str) -> None:
        key = decision.reason if pool == "mixed" else f"{pool}:{decision.reason}"
        self.decisions[key] += 1
        self.decision_counter.labels(pool, decision.reason).inc()

    async def check_health(self) -> None:
        for worker in self.pools.workers:
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


def build_router_app(pools: Pools | Router, health_interval: float = 1.0) -> FastAPI:
    if isinstance(pools, Router):
        pools = Pools(mixed=pools)
    state = RouterState(pools, health_interval)

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
        for worker in pools.healthy():
            with contextlib.suppress(httpx.HTTPError):
                response = await state.client.get(f"{worker.url}/v1/models", timeout=5.0)
                return Response(response.content, response.status_code,
                                media_type="application/json")  # fmt: skip
        return _no_workers()

    @app.get("/health")
    async def health():
        if not pools.healthy():
            return _no_workers()
        return {"status": "ok", "workers": len(pools.healthy())}

    @app.get("/load")
    async def load():
        return {
            "workers": [
                {"url": w.url, "pool": w.kind, "healthy": w.healthy,
                 "tokens_in_flight": w.tokens_in_flight,
                 "requests_in_flight": w.requests_in_flight, "reported": w.reported}
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


def _no_workers() -> JSONResponse:
    body = error_body(503, "no healthy worker: every worker of this router is down")
    return JSONResponse(body, status_code=503)


def _prompt_text(body: dict) -> str:
    """The text the prompt is made of, for prefix matching (messages in order)."""
    if "messages" in body:
        return "".join(f"{m.get('role')}:{json.dumps(m.get('content'))}\n"
                       for m in body["messages"] if isinstance(m, dict))  # fmt: skip
    return json.dumps(body.get("prompt"))


def _disaggregable(body: dict) -> bool:
    """One sequence from one prompt (what a prefill can hand to a decode worker)."""
    if body.get("n") not in (None, 1) or "kv_transfer_params" in body:
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


async def _forward(state: RouterState, request: Request, path: str):
    raw = await request.body()
    try:
        body = json.loads(raw)
    except json.JSONDecodeError:
        return JSONResponse(error_body(400, "malformed JSON body"), status_code=400)
    if not isinstance(body, dict):
        return JSONResponse(error_body(400, "the body must be a JSON object"), status_code=400)
    call = _Call(state, request, path, raw, body)
    pools = state.pools
    if pools.disaggregated and _disaggregable(body):
        response = await call.disaggregated()
        if response is not None:
            return response
    return await call.whole(pools.for_whole_requests())


class _Call:
    """One client request on its way through the router."""

    def __init__(self, state: RouterState, request: Request, path: str, raw: bytes, body: dict):
        self.state, self.path, self.raw, self.body = state, path, raw, body
        self.session_id = request.headers.get(SESSION_HEADER)
        self.headers = {k: v for k, v in request.headers.items()
                        if k.lower() in ("authorization", SESSION_HEADER, "content-type")}  # fmt: skip
        self.text = _prompt_text(body)
        try:
            self.max_tokens = int(
                body.get("max_completion_tokens") or body.get("max_tokens") or 256
            )
        except (TypeError, ValueError):
            self.max_tokens = 256  # the worker will answer the bad value with a 400

    async def whole(self, router: Router, raw=None, extra=None, fallback: Worker | None = None):
        """Runs the request on one worker of `router`'s pool (or, when none is left,
        `fallback`), retrying on another while a worker is unreachable; relays its response."""
        state, tried = self.state, set()
        while True:
            decision = router.choose(self.text, self.max_tokens, self.session_id, tried)
            if decision is None and fallback is not None and fallback.url not in tried:
                decision = Decision(fallback, "fallback", self.max_tokens, [])
            elif decision is None:
                return _no_workers()
            elif tried:
                decision = Decision(decision.worker, "retry", decision.cost, decision.hashes)
            state.decide(decision, router.workers[0].kind)
            router.start(decision)
            try:
                upstream = await self._send(decision, raw or self.raw, stream=True)
            except httpx.TransportError as exc:
                upstream, why = None, f"unreachable ({exc})"
            else:
                why = "unavailable (503)" if upstream.status_code == 503 else None
            if why is None:
                return _relay(state, router, decision, upstream, self.session_id, extra)
            if upstream is not None:  # its engine is gone; nothing was started there
                await upstream.aclose()
            self._worker_down(router, decision, why, tried)

    async def disaggregated(self):
        """Prefill on one worker, decode on another; None when no prefill worker is up
        (the caller then runs the request whole)."""
        state, pools = self.state, self.state.pools
        prefill_raw = json.dumps(dict(self.body, kv_transfer_params={"do_remote_decode": True}))
        tried: set[str] = set()
        while True:
            decision = pools.prefill.choose(self.text, 1, self.session_id, tried)
            if decision is None:
                return None
            if tried:
                decision = Decision(decision.worker, "retry", decision.cost, decision.hashes)
            state.decide(decision, "prefill")
            pools.prefill.start(decision)
            try:
                response = await self._send(decision, prefill_raw.encode(), stream=False)
            except httpx.TransportError as exc:
                self._worker_down(pools.prefill, decision, f"unreachable ({exc})", tried)
                continue
            pools.prefill.finish(decision)
            if response.status_code != 503:
                break
            self._worker_down(pools.prefill, decision, "unavailable (503)", tried, finish=False)
        prefill_url = decision.worker.url
        kv = _handed_over(response) if response.status_code == 200 else None
        if kv is None:  # an error, or the request finished on the prefill worker
            media_type = response.headers.get("content-type", "application/json")
            state.record_usage(_usage(response.content[-4096:]))
            headers = {WORKER_HEADER: prefill_url, PREFILL_HEADER: prefill_url}
            if self.session_id:
                headers[SESSION_HEADER] = self.session_id
            return Response(response.content, response.status_code, headers=headers,
                            media_type=media_type)  # fmt: skip
        decode_raw = json.dumps(dict(self.body, kv_transfer_params=kv)).encode()
        extra = {PREFILL_HEADER: prefill_url}
        return await self.whole(pools.decode, decode_raw, extra, fallback=decision.worker)

    async def _send(self, decision: Decision, raw: bytes, stream: bool) -> httpx.Response:
        request = self.state.client.build_request(
            "POST", f"{decision.worker.url}{self.path}", content=raw, headers=self.headers
        )
        return await self.state.client.send(request, stream=stream)

    def _worker_down(self, router, decision, why: str, tried: set[str], finish=True) -> None:
        if finish:
            router.finish(decision)
        logger.warning("worker %s %s; retrying elsewhere", decision.worker.url, why)
        decision.worker.healthy = False
        tried.add(decision.worker.url)


def _handed_over(response: httpx.Response) -> dict | None:
    """The `kv_transfer_params` of a prefill worker's answer (JSON body or SSE stream)."""
    if "event-stream" not in response.headers.get("content-type", ""):
        with contextlib.suppress(ValueError):
            return response.json().get("kv_transfer_params")
        return None
    for line in response.text.splitlines():
        if line.startswith("data: {") and '"kv_transfer_params"' in line:
            with contextlib.suppress(ValueError):
                return json.loads(line[6:]).get("kv_transfer_params")
    return None


def _relay(state, router, decision, upstream: httpx.Response, session_id, extra=None):
    headers = {WORKER_HEADER: decision.worker.url, **(extra or {})}
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
            router.finish(decision)
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

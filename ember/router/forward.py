"""How the router forwards one client request to its workers, and relays the answer.

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

A worker that cannot be reached, or refuses the request because its engine is gone
(a 503 coded `engine_not_running`), leaves its pool and the request is retried on
another (reason "retry"); when no worker is healthy the client gets a 503 saying so. A
worker whose queue is full (429) is skipped for this request; when every worker is, the
client gets the last 429 and its Retry-After. A request a worker failed on after taking
it (the worker died before answering, or its engine stopped with the request in it: a
503 or an error event coded `engine_stopped`, from a prefill worker too) goes to another
worker at most --max-migrations times in all: it may be what failed the worker, and must
not take down every worker in turn. A stream whose worker fails once it has begun is
moved (`migrate.py`); one that cannot be moved ends with an OpenAI error event and
[DONE].

Anthropic's Messages API (`/v1/messages`) runs whole, never split between prefill and
decode; its session is `x-session-affinity`, else the body's `metadata.user_id`; the
router's own errors on it are in Anthropic's shape (a cut stream ends with `event: error`).
What any worker answers alike (the tokenizer's /tokenize and /detokenize) goes to the
least loaded healthy worker, and to the next when one cannot be reached or fails on it
(tokenizing twice does no harm).

Clients cannot send `kv_transfer_params` (a 400 naming it): that field is the router's
own. With the cluster secret the router shows its workers its token on every request
(`ember.cluster`), so workers can serve it alone. The usage of every response is read on
the way through for the cluster's cache hit ratio.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ember.headers import (
    PREFILL_HEADER,
    RESPONSE_ID_HEADER,
    SESSION_HEADER,
    STREAM_TOKENS_HEADER,
    TENANT_HEADER,
    WORKER_HEADER,
)
from ember.router.migrate import Leg, Splice, movable, moving_events, stream_end
from ember.router.policy import Decision, Pools, Router, Worker
from ember.router.state import RouterState
from ember.server.errors import (
    ENGINE_NOT_RUNNING,
    ENGINE_STOPPED,
    MESSAGES_PATH,
    RESPONSES_PATH,
    error_body_for,
    error_code_of,
)

logger = logging.getLogger("ember.router")


def no_workers(path: str = "") -> JSONResponse:
    body = error_body_for(path, 503, "no healthy worker: every worker of this router is down")
    return JSONResponse(body, status_code=503)


def _prompt_text(body: dict) -> str:
    """The text the prompt is made of, for prefix matching (messages in order, after
    the Messages API's top-level system prompt)."""
    if "messages" in body:
        system = f"system:{json.dumps(body['system'])}\n" if body.get("system") else ""
        messages = body["messages"] if isinstance(body["messages"], list) else []  # (a 400 there)
        return system + "".join(f"{m.get('role')}:{json.dumps(m.get('content'))}\n"
                                for m in messages if isinstance(m, dict))  # fmt: skip
    if "input" in body:  # /v1/responses
        return f"{json.dumps(body.get('instructions'))}{json.dumps(body['input'])}"
    return json.dumps(body.get("prompt"))


def _session_id(request: Request, path: str, body: dict) -> str | None:
    """x-session-affinity, else (Messages API) the conversation's metadata.user_id."""
    session_id = request.headers.get(SESSION_HEADER)
    if session_id or path != MESSAGES_PATH or not isinstance(body.get("metadata"), dict):
        return session_id
    user_id = body["metadata"].get("user_id")
    return user_id if isinstance(user_id, str) and user_id else None


def client_headers(request: Request) -> dict[str, str]:
    """The client's headers a worker gets (its key, when workers check one themselves)."""
    return {k: v for k, v in request.headers.items()
            if k.lower() in ("authorization", "x-api-key", SESSION_HEADER,
                             "content-type")}  # fmt: skip


def _disaggregable(body: dict) -> bool:
    """One sequence from one prompt (what a prefill can hand to a decode worker)."""
    if body.get("n") not in (None, 1):
        return False
    prompt = body.get("prompt")
    return not (isinstance(prompt, list) and prompt and not isinstance(prompt[0], int))


async def forward(state: RouterState, request: Request, path: str):
    """Answers one client request (chat, completions, messages or responses) through the
    workers."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the stack
        return JSONResponse(error_body_for(path, 400, "malformed JSON body"), status_code=400)
    if not isinstance(body, dict):
        body = error_body_for(path, 400, "the body must be a JSON object")
        return JSONResponse(body, status_code=400)
    if "kv_transfer_params" in body:
        message = "kv_transfer_params is set by ember's router, never by a client"
        body = error_body_for(path, 400, message, "kv_transfer_params", "invalid_value")
        return JSONResponse(body, status_code=400)
    pools = state.fleet.pools_for(body.get("model"))
    if pools is None:
        return _no_pool(state, path, body.get("model"))
    call = _Call(state, pools, request, path, raw, body)
    whole_only = path in (MESSAGES_PATH, RESPONSES_PATH)  # no prefill/decode split there
    if pools.disaggregated and not whole_only and _disaggregable(body):
        response = await call.disaggregated()
        if response is not None:
            return response
    return await call.whole(pools.for_whole_requests())


async def to_any_worker(state: RouterState, request: Request, path: str) -> Response:
    """Answers a request that every worker answers the same way, from one of them."""
    raw = await request.body()
    headers = {**client_headers(request), **state.worker_headers}
    try:
        model = json.loads(raw).get("model")
    except (ValueError, RecursionError, AttributeError):
        model = None  # the worker answers the malformed body
    pools = state.fleet.pools_for(model)
    workers = pools.healthy() if pools is not None else state.fleet.healthy()
    for worker in sorted(workers, key=lambda w: w.tokens_in_flight):
        try:
            response = await state.client.post(f"{worker.url}{path}", content=raw, headers=headers)
        except httpx.TransportError as exc:
            logger.warning("worker %s failed on %s (%r); trying another", worker.url, path, exc)
            continue
        media_type = response.headers.get("content-type", "application/json")
        return Response(response.content, response.status_code, media_type=media_type,
                        headers={WORKER_HEADER: worker.url})  # fmt: skip
    return no_workers()


def _no_pool(state: RouterState, path: str, model: object) -> JSONResponse:
    """No pool for the model a request names: a 404 naming those there are (a 503 when
    the router has no worker at all)."""
    names = state.fleet.model_names()
    if not state.fleet.models:
        return no_workers(path)
    message = f"The model `{model}` does not exist; this router serves {', '.join(names)}."
    body = error_body_for(path, 404, message, "model", "model_not_found")
    return JSONResponse(body, status_code=404)


class _Call:
    """One client request on its way through the router, to `pools` (its model's)."""

    def __init__(
        self, state: RouterState, pools: Pools, request: Request, path: str, raw: bytes, body: dict
    ):
        self.state, self.pools, self.path, self.raw, self.body = state, pools, path, raw, body
        self.session_id = _session_id(request, path, body)
        self.headers = {**client_headers(request), **state.worker_headers}
        if tenant := getattr(request.state, "tenant", None):  # its key's: salts its cache
            self.headers[TENANT_HEADER] = tenant
        self.text = _prompt_text(body)
        self.num_failures = 0  # workers that died with this request on them
        # a stream the router moves when its worker fails (`migrate.py`): it asks for the
        # token trail, and gives an unseeded stream a seed so the next worker draws alike
        self.movable = movable(path, body, _disaggregable(body), state.cluster_secret)
        if self.movable and body.get("seed") is None:
            self.body = body = dict(body, seed=secrets.randbits(63))
            self.raw = json.dumps(body).encode()
        trail = {STREAM_TOKENS_HEADER: "1"} if self.movable else {}
        self.stream_headers = {**self.headers, **trail}
        # a /v1/responses turn goes where the response it continues is stored
        previous = body.get("previous_response_id")
        self.pinned = state.response_homes.get(previous) if isinstance(previous, str) else None
        try:
            self.max_tokens = int(
                body.get("max_completion_tokens")
                or body.get("max_tokens")
                or body.get("max_output_tokens")
                or 256
            )
        except (TypeError, ValueError, OverflowError):  # (Infinity: Python's JSON reads it)
            self.max_tokens = 256  # the worker will answer the bad value with a 400

    async def whole(self, router: Router, raw=None, extra=None, fallback: Worker | None = None):
        """Runs the request on one worker of `router`'s pool (or, when none is left,
        `fallback`), retrying on another while a worker is unreachable; relays its response
        (a movable stream through `moving_events`)."""
        opened = await self._open(router, raw or self.raw, set(), fallback)
        if isinstance(opened, Response):
            return opened
        router, decision, upstream = opened
        headers = self._response_headers(decision.worker, extra)
        media_type = upstream.headers.get("content-type", "application/json")
        if self.movable and upstream.status_code == 200 and "event-stream" in media_type:
            state = self.state
            events = moving_events(
                self.path,
                self._leg(router, decision, upstream),
                self._reopen,
                state.migration,
                lambda tail: state.record_usage(_usage(tail)),
            )
            return StreamingResponse(events, 200, headers=headers, media_type=media_type)
        return _relay(self.state, router, decision, upstream, headers, self.path)

    async def _open(self, router: Router, raw: bytes, tried: set[str], fallback=None, reason=None):
        """(pool, decision, response) of the first worker of `router`'s pool (or
        `fallback`) that takes the request, the others tried left out of it and added to
        `tried`; or the Response that ends the request. `reason`: the decisions' own."""
        state, full = self.state, None
        while True:
            decision = router.choose(
                self.text, self.max_tokens, self.session_id, tried, self.pinned
            )
            if decision is None and fallback is not None and fallback.url not in tried:
                decision = Decision(fallback, "fallback", self.max_tokens, [])
            elif decision is None:  # every worker full (the last one's 429), or down
                return full if full is not None else no_workers(self.path)
            elif tried or reason:
                reason = reason or "retry"
                decision = Decision(decision.worker, reason, decision.cost, decision.hashes)
            state.decide(decision, decision.worker.kind)
            router.start(decision)
            try:
                upstream = await self._send(decision, raw, True, self.stream_headers)
            except httpx.TransportError as exc:
                if self._may_retry(exc):
                    self._worker_down(router, decision, f"unreachable ({exc!r})", tried)
                    continue
                router.finish(decision)
                return _failed_on(decision.worker, exc, self.path)
            if upstream.status_code == 429:  # that worker's queue is full: try the next
                content = await upstream.aread()
                await upstream.aclose()
                router.finish(decision)
                tried.add(decision.worker.url)
                retry_after = upstream.headers.get("retry-after", "1")
                full = Response(content, 429, media_type="application/json",
                                headers={"Retry-After": retry_after})  # fmt: skip
                continue
            if upstream.status_code == 503:
                content = await upstream.aread()
                await upstream.aclose()
                if self._engine_gone(error_code_of(content, upstream.headers)):
                    self._worker_down(router, decision, "its engine is down (503)", tried)
                    continue
                router.finish(decision)
                return Response(content, 503, headers=self._response_headers(decision.worker),
                                media_type="application/json")  # fmt: skip
            if response_id := upstream.headers.get(RESPONSE_ID_HEADER):
                state.remember_response(response_id, decision.worker.url)
            return router, decision, upstream

    def _leg(self, router: Router, decision: Decision, upstream: httpx.Response) -> Leg:
        async def end(failed: bool) -> None:
            await upstream.aclose()
            router.finish(decision)
            if failed:  # the health loop brings it back once it answers again
                decision.worker.healthy = False

        return Leg(upstream, decision.worker.url, end)

    async def _reopen(self, splice: Splice, tried: set[str]) -> Leg | bytes | None:
        """The next worker's leg of a moved stream (`migrate.py`): its last events when the
        worker refused it, None when there is no worker to take it."""
        if splice.num_events == 0:  # the client has had nothing: start afresh
            raw = self.raw
        else:
            raw = json.dumps(dict(self.body, resume_params=splice.resume_params())).encode()
        pool = self.pools.for_whole_requests()
        opened = await self._open(pool, raw, tried, reason="migrate")
        if isinstance(opened, Response):
            if opened.status_code == 503:
                return None
            return stream_end(splice, opened.status_code, opened.body)
        router, decision, upstream = opened
        if upstream.status_code != 200:
            content = await upstream.aread()
            await upstream.aclose()
            router.finish(decision)
            return stream_end(splice, upstream.status_code, content)
        return self._leg(router, decision, upstream)

    async def disaggregated(self):
        """Prefill on one worker, decode on another; None when no prefill worker is up
        (the caller then runs the request whole)."""
        state, pools = self.state, self.pools
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
                response = await self._send(decision, prefill_raw.encode(), False, self.headers)
            except httpx.TransportError as exc:
                if self._may_retry(exc):
                    self._worker_down(pools.prefill, decision, f"unreachable ({exc!r})", tried)
                    continue
                pools.prefill.finish(decision)
                return _failed_on(decision.worker, exc, self.path)
            pools.prefill.finish(decision)
            if not self._engine_gone(_failure_code(response)):
                break
            self._worker_down(pools.prefill, decision, "its engine is down", tried, finish=False)
        prefill_url = decision.worker.url
        kv = _handed_over(response) if response.status_code == 200 else None
        if kv is None:  # an error, or the request finished on the prefill worker
            media_type = response.headers.get("content-type", "application/json")
            state.record_usage(_usage(response.content[-4096:]))
            headers = self._response_headers(decision.worker, {PREFILL_HEADER: prefill_url})
            return Response(response.content, response.status_code, headers=headers,
                            media_type=media_type)  # fmt: skip
        decode_raw = json.dumps(dict(self.body, kv_transfer_params=kv)).encode()
        extra = {PREFILL_HEADER: prefill_url}
        return await self.whole(pools.decode, decode_raw, extra, fallback=decision.worker)

    async def _send(self, decision: Decision, raw: bytes, stream: bool, headers) -> httpx.Response:
        request = self.state.client.build_request(
            "POST", f"{decision.worker.url}{self.path}", content=raw, headers=headers
        )
        return await self.state.client.send(request, stream=stream)

    def _may_retry(self, exc: httpx.TransportError) -> bool:
        """A request that never reached a worker is retried; one that reached a worker that
        then died before answering (killed, restarted) is sent again up to --max-migrations
        times: it may be what killed the worker, and must not take down every worker."""
        return _never_reached(exc) or self._may_resend()

    def _may_resend(self) -> bool:
        """Whether a request a worker failed on may go to another (--max-migrations)."""
        self.num_failures += 1
        return self.num_failures <= self.state.migration.max_migrations

    def _engine_gone(self, code: str | None) -> bool:
        """Whether a worker's answer says its engine is down: before it started the
        request (sent elsewhere), or with the request in it (sent elsewhere, within the
        bound on failures)."""
        return code == ENGINE_NOT_RUNNING or (code == ENGINE_STOPPED and self._may_resend())

    def _response_headers(self, worker: Worker, extra: dict | None = None) -> dict[str, str]:
        headers = {WORKER_HEADER: worker.url, **(extra or {})}
        if self.session_id:
            headers[SESSION_HEADER] = self.session_id
        return headers

    def _worker_down(self, router, decision, why: str, tried: set[str], finish=True) -> None:
        if finish:
            router.finish(decision)
        logger.warning("worker %s %s; retrying elsewhere", decision.worker.url, why)
        decision.worker.healthy = False
        tried.add(decision.worker.url)


def _never_reached(exc: httpx.TransportError) -> bool:
    """Whether the request failed before any of it reached the worker (safe to retry)."""
    return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.PoolTimeout)


def _failed_on(worker: Worker, exc: Exception, path: str) -> JSONResponse:
    logger.warning("worker %s failed while handling a request (%s); not retried", worker.url, exc)
    message = f"the worker failed while handling this request ({type(exc).__name__})"
    body = error_body_for(path, 502, message, None, "worker_failed")
    return JSONResponse(body, status_code=502, headers={WORKER_HEADER: worker.url})


def _failure_code(response: httpx.Response) -> str | None:
    """The ember code of a whole answer's error: its error body's, or (an SSE stream) its
    error event's."""
    if response.status_code != 200:
        return error_code_of(response.content, response.headers)
    if "event-stream" not in response.headers.get("content-type", ""):
        return None
    for line in response.text.splitlines():
        if line.startswith('data: {"error"'):
            return error_code_of(line[6:].encode(), response.headers)
    return None


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


def _relay(state, router, decision, upstream: httpx.Response, headers: dict[str, str], path):
    media_type = upstream.headers.get("content-type", "application/json")
    event_stream = "event-stream" in media_type
    keep = 4096 if event_stream else 1 << 20  # SSE: its last chunk suffices

    async def body():
        tail = b""
        try:
            async for chunk in upstream.aiter_raw():
                tail = (tail + chunk)[-keep:]
                yield chunk
        except httpx.HTTPError as exc:  # the worker died mid-response
            logger.warning("worker %s failed mid-response (%s)", decision.worker.url, exc)
            if event_stream:  # end the client's stream properly, from an event boundary
                lead = b"" if tail.endswith(b"\n\n") or not tail else b"\n\n"
                yield lead + _cut_stream_end(exc, path)
        finally:
            await upstream.aclose()
            router.finish(decision)
            state.record_usage(_usage(tail))

    return StreamingResponse(body(), upstream.status_code, headers=headers, media_type=media_type)


def _cut_stream_end(exc: Exception, path: str) -> bytes:
    """The last events of a stream whose worker failed mid-way."""
    message = f"the worker failed while streaming this response ({type(exc).__name__})"
    event = json.dumps(error_body_for(path, 502, message, None, "worker_failed"))
    if path == MESSAGES_PATH:
        return f"event: error\ndata: {event}\n\n".encode()
    return f"data: {event}\n\ndata: [DONE]\n\n".encode()


def _usage(tail: bytes) -> dict | None:
    """The usage block of a response, from its last bytes (JSON body or final SSE chunk)."""
    text = tail.decode(errors="ignore")
    for candidate in reversed(text.replace("data: ", "\n").splitlines()):
        candidate = candidate.strip()
        if '"usage"' in candidate and candidate.startswith("{"):
            with contextlib.suppress(ValueError):
                return json.loads(candidate).get("usage")
    return None

"""The FastAPI application: routes, API keys, session affinity, disconnects.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, POST
/v1/responses and GET /v1/responses/{id} (SSE when `stream`), POST /v1/messages
(Anthropic's Messages API over the chat path, errors in Anthropic's shape), POST /tokenize
and /detokenize (vLLM's shapes), GET /health, GET /metrics (Prometheus), GET /load (JSON
for routers). Who may call and how large a body may be is checked first (`guard.py`: API
key, or on a worker of a cluster the router's token; --max-request-bytes); /health stays
open. The request
header `x-session-affinity` becomes the engine request's session id, is logged, and is
echoed on the response. A client that goes away mid-request cancels the handler, which
aborts its engine requests (their KV blocks are freed at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ember.engine.async_llm import AsyncLLM
from ember.headers import RESPONSE_ID_HEADER, SESSION_HEADER, STREAM_TOKENS_HEADER
from ember.server.errors import APIError, error_body, install_error_handlers
from ember.server.guard import Access, Guard, tenant_salt
from ember.server.limits import DEFAULT_STORE_CHARS
from ember.server.metrics import ServerMetrics
from ember.server.parsers import ChatParsers
from ember.server.protocol import ChatCompletionRequest, CompletionRequest
from ember.server.protocol_responses import ResponsesRequest
from ember.server.resume import resume_of
from ember.server.serving import RequestContext, kv_transfer_of
from ember.server.serving_chat import ChatServing
from ember.server.serving_completion import CompletionServing
from ember.server.serving_messages import MessagesServing, anthropic_error, parse_request
from ember.server.serving_responses import (
    ResponsesServing,
    ResponseStore,
    new_response_id,
)
from ember.server.serving_tokenize import DetokenizeRequest, TokenizeRequest, TokenizeServing

logger = logging.getLogger("ember.server")


def build_app(
    llm: AsyncLLM,
    model_name: str,
    access: Access | None = None,
    max_queued_requests: int | None = None,
    parsers: ChatParsers | None = None,
    response_store_chars: int = DEFAULT_STORE_CHARS,
) -> FastAPI:
    access = access or Access()
    app = FastAPI(title="ember", docs_url=None, redoc_url=None)
    metrics = ServerMetrics(model_name)
    secret = access.cluster_secret
    chat = ChatServing(llm, model_name, metrics, max_queued_requests, secret, parsers=parsers)
    completions = CompletionServing(llm, model_name, metrics, max_queued_requests, secret)
    messages = MessagesServing(chat, reasoning=chat.parsers.reasoning is not None)
    responses = ResponsesServing(chat, ResponseStore(response_store_chars))
    tokenization = TokenizeServing(llm, model_name, metrics)
    install_error_handlers(app)
    app.state.llm = llm
    app.state.metrics = metrics
    app.state.cluster_secret = secret
    app.add_middleware(Guard, access=access)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "ember",
                    "max_model_len": llm.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request):
        return await _serve(completions, body, request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        return await _serve(chat, body, request)

    @app.post("/v1/messages")
    async def create_message(request: Request):
        try:
            return await _serve(messages, parse_request(await request.body()), request)
        except APIError as exc:
            return anthropic_error(exc)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        ctx = _stream_context(request, _context(request), body)
        # known before a stream starts: routers keep it (a moved stream keeps its own)
        response_id = new_response_id() if ctx.resume is None else ctx.resume.id
        work = responses.create(body, ctx, response_id)
        return await _respond(work, request, {RESPONSE_ID_HEADER: response_id})

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return responses.retrieve(response_id)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        return await tokenization.tokenize(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return await tokenization.detokenize(body)

    @app.get("/health")
    async def health():
        if llm.dead:
            message = "the engine is restarting" if llm.restarting else "the engine is not running"
            return JSONResponse(error_body(503, message), status_code=503)
        return {"status": "ok"}

    @app.get("/load")
    async def load():
        stats = llm.stats()
        return {
            "num_waiting": llm.num_waiting,
            "num_preparing": llm.num_preparing,  # being checked and tokenized here
            "num_running": stats.num_running,
            "num_queued_prefill_tokens": stats.num_queued_prefill_tokens,
            "kv_blocks_used": stats.kv_blocks_used,
            "kv_blocks_total": stats.kv_blocks_total,
            "block_size": llm.block_size,
            "kv_bytes_per_token": stats.kv_block_bytes // llm.block_size,
            "step_limits": {**llm.step_limits, "target_itl_ms": stats.target_itl_ms},
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_prompt_tokens_computed": stats.num_prompt_tokens_computed,
            "role": llm.role,
            "model": model_name,  # a router keeps a pool per model
            "parallel": llm.parallel,
            "kv_store": llm.kv_store,  # workers naming the same store share their KV
            "kv_transfer": {
                "waiting_for_kv": stats.num_waiting_for_kv,
                "loads_ok": stats.kv_loads_ok,
                "loads_failed": stats.kv_loads_failed,
                "bytes_received": stats.kv_bytes_received,
                "load_seconds": stats.kv_load_seconds,
                "held": stats.kv_held,
                "holds_expired": stats.kv_holds_expired,
                "bytes_sent": stats.kv_bytes_sent,
            },
            "kv_tiers": stats.kv_tiers,  # hits, bytes and load time per tier, evictions, ...
            "spec_decode": stats.spec_decode,  # drafts proposed and accepted, if speculating
            "healthy": not llm.dead,
            "engine_restarts": llm.num_restarts,
        }

    @app.get("/metrics")
    async def prometheus():
        text = metrics.render(
            llm.stats(), llm.num_waiting, llm.expert_tokens(), llm.expert_ranks, llm.num_restarts
        )
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _serve(serving, body, request: Request):
    secret = request.app.state.cluster_secret
    ctx = _context(request, body.cache_salt, kv_transfer_of(body, secret), body.kv_retention)
    return await _respond(serving.create(body, _stream_context(request, ctx, body)), request)


def _stream_context(request: Request, ctx: RequestContext, body) -> RequestContext:
    """`ctx` with what a router asks of a stream: its token trail, and where a moved
    stream goes on from (`resume.py`)."""
    trail = request.headers.get(STREAM_TOKENS_HEADER) == "1"
    resume = resume_of(body, request.app.state.cluster_secret)
    return dataclasses.replace(ctx, resume=resume, trail=trail)


def _context(
    request: Request, cache_salt=None, kv_transfer=None, kv_retention=None
) -> RequestContext:
    session_id = request.headers.get(SESSION_HEADER)
    if session_id:
        logger.info("%s session=%s", request.url.path, session_id)
    cache_salt = tenant_salt(getattr(request.state, "tenant", None), cache_salt)
    return RequestContext(session_id, cache_salt, kv_transfer, kv_retention=kv_retention)


async def _respond(work, request: Request, headers: dict[str, str] | None = None):
    """Runs an endpoint's work (until the client leaves) and sends its JSON or SSE."""
    headers = dict(headers or {})
    if session_id := request.headers.get(SESSION_HEADER):
        headers[SESSION_HEADER] = session_id
    with request.app.state.llm.preparing():  # until it reaches the engine
        result = await _until_disconnect(work, request)
    if isinstance(result, dict):
        return JSONResponse(result, headers=headers)
    return StreamingResponse(result, media_type="text/event-stream", headers=headers)


async def _until_disconnect(work, request: Request):
    """Runs `work`, cancelling it if the client disconnects first (a non-streaming
    request would otherwise run to the end for nobody)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise APIError(499, "client disconnected")


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass

"""What the endpoints share: admission checks, running engine requests, usage, SSE framing.

A handler checks everything it can before the engine sees the request (model name, the
parameters, prompt length against the context, queue room), so a bad request is a 400
and never reaches the engine. It then admits the request and sends one engine request
per prompt in one synchronous step (`start`: no await between the queue check and the
send, so a burst cannot overshoot --max-queued-requests), and either collects the final
outputs or streams chunks as SSE, observed by the metrics. Errors that can only happen
later (the engine died, the server is shutting down) end a stream with an OpenAI error
event. Every way out (error, client gone, a body never sent) aborts what still runs.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from ember.engine.async_llm import AsyncLLM, EngineDeadError, RequestStream
from ember.engine.processor import ProcessedPrompt, Truncation
from ember.kv.params import KVTransferParams, decode_params
from ember.outputs import RequestOutput
from ember.sampling_params import SamplingParams
from ember.server.errors import ENGINE_NOT_RUNNING, ENGINE_STOPPED, APIError, error_body
from ember.server.metrics import ServerMetrics
from ember.server.resume import ResumeParams

_encode = msgspec.json.Encoder().encode
logger = logging.getLogger("ember.server")

RETRY_AFTER_S = 1  # a 429's Retry-After: queues turn over in about a step


@dataclass(frozen=True)
class LogprobForm:
    """How a request's logprobs read: `top` alternatives to each token, each token named
    by its text or, with vLLM's `return_tokens_as_token_ids`, as "token_id:N" (distinct
    tokens can share a text; never an id)."""

    top: int = 0
    token_ids: bool = False

    @classmethod
    def of(cls, request, params: SamplingParams) -> LogprobForm:
        return cls(params.logprobs or 0, bool(request.return_tokens_as_token_ids))


@dataclass(frozen=True)
class RequestContext:
    """Per HTTP request: the parts of it every engine request carries."""

    session_id: str | None = None
    cache_salt: str | None = None
    kv_transfer: KVTransferParams | None = None
    kv_retention: str | None = None  # "session": keep the prompt's KV as a session's
    resume: ResumeParams | None = None  # a stream moved here from another worker
    trail: bool = False  # the router asked for the stream's token trail (`resume.py`)
    # called with each engine output before the endpoint answers from it: what an API
    # layered on another endpoint reads there (usage, the stop string that matched)
    observe: Callable[[RequestOutput], None] | None = None
    # called, on a resumed stream, with the chat chunk the resumed tokens' text makes
    # (never sent): how such a layer rebuilds what its client has had (`resume.py`)
    replayed: Callable[[dict], None] | None = None
    request_id: str | None = None  # the id an API layered on another gives its request


def kv_transfer_of(body, secret: bytes | None) -> KVTransferParams | None:
    """The request's checked `kv_transfer_params` (a 400 naming it when malformed or not
    signed). Only a cluster's router can send it: a worker with the cluster secret serves
    no one else (see `app.py`), and a worker without one refuses the field."""
    if body.kv_transfer_params is None:
        return None
    if secret is None:
        raise APIError(
            400,
            "kv_transfer_params is accepted only from the router of an ember cluster "
            "(this worker has no EMBER_CLUSTER_SECRET)",
            "kv_transfer_params",
            "invalid_value",
        )
    try:
        return decode_params(body.kv_transfer_params, secret)
    except ValueError as exc:
        raise APIError(400, str(exc), "kv_transfer_params", "invalid_value") from None


class ServingBase:
    def __init__(
        self,
        llm: AsyncLLM,
        model_name: str,
        metrics: ServerMetrics,
        max_queued_requests: int | None = None,
        cluster_secret: bytes | None = None,
    ) -> None:
        self.llm = llm
        self.model_name = model_name
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        self.cluster_secret = cluster_secret  # signs the prefills this worker hands over
        self._token_texts: dict[int, str] = {}

    # -- admission ----------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model", "model_not_found")

    def check_capacity(self, num_sequences: int) -> None:
        """A 429 unless `num_sequences` more waiting sequences stay within
        --max-queued-requests (a request larger than the limit is let in only when nothing
        waits). Admission is exact only when the request is added with no await between
        this check and the engine's `add_request` (as `start` does)."""
        if self.llm.dead:
            message = "the engine is not running; the server cannot serve requests"
            raise APIError(503, message, code=ENGINE_NOT_RUNNING)
        limit = self.max_queued_requests
        waiting = self.llm.num_waiting
        if limit is not None and waiting and waiting + num_sequences > limit:
            raise APIError(
                429,
                f"too many waiting requests ({waiting}, the limit is {limit}); retry later",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )

    async def check_prompt(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        param: str = "prompt",
        add_special_tokens: bool = True,
        truncation: Truncation | None = None,
    ) -> ProcessedPrompt:
        """Tokenizes (in a thread: a long prompt must not stall the event loop), cuts to
        `truncation` and checks the prompt fits; a 400 names `param` for a prompt error."""
        try:
            processed = await asyncio.to_thread(
                self.llm.process_prompt, prompt, add_special_tokens, truncation, params.max_tokens
            )
            self.llm.input_processor.check(processed, params)
        except ValueError as exc:
            error = APIError.bad_request(exc)
            if error.param == "prompt":
                error.param = param
            raise error from None
        return processed

    # -- running ------------------------------------------------------------------------

    def start(
        self,
        prompts: dict[str, ProcessedPrompt],
        params: SamplingParams,
        ctx: RequestContext,
        grammar: str | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Admits the request and sends one engine request per prompt (keyed by request
        id), all synchronously, so that concurrent requests cannot overshoot the queue
        limit; their streams, observed by the metrics. On an error nothing is left running.
        """
        self.check_capacity(len(prompts) * params.n)
        streams: list[RequestStream] = []
        try:
            for request_id, prompt in prompts.items():
                stream = self.llm.add_request(
                    prompt,
                    params,
                    request_id,
                    cache_salt=ctx.cache_salt,
                    session_id=ctx.session_id,
                    grammar=grammar,
                    kv_transfer=ctx.kv_transfer,
                    kv_retention=ctx.kv_retention,
                    resume_token_ids=None if ctx.resume is None else ctx.resume.token_ids,
                )
                streams.append(stream)
        except BaseException as exc:
            for stream in streams:
                stream.close()
            if isinstance(exc, EngineDeadError):  # the core is gone: nothing runs anywhere
                raise APIError(503, str(exc), code=ENGINE_NOT_RUNNING) from None
            if isinstance(exc, ValueError):
                raise APIError.bad_request(exc) from None
            raise
        return [self._observe(stream, ctx.observe) for stream in streams]

    async def _observe(self, stream: RequestStream, observe=None) -> AsyncIterator[RequestOutput]:
        timer = self.metrics.timer()
        finished = False
        try:
            async for output in stream:
                timer.observe(output)
                finished = output.finished
                if observe is not None:
                    observe(output)
                yield output
        finally:
            stream.close()  # aborts it unless it ended
            if not finished:
                timer.aborted()

    async def collect(self, streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
        """The final output of each stream; engine errors become API errors."""

        async def last(stream):
            final = None
            async for output in stream:
                final = output
            return final

        tasks = [asyncio.ensure_future(last(s)) for s in streams]
        try:
            return list(await asyncio.gather(*tasks))
        except EngineDeadError as exc:  # coded so a router sends it elsewhere
            code = ENGINE_STOPPED if exc.started else ENGINE_NOT_RUNNING
            raise APIError(503, str(exc), code=code) from None
        except ValueError as exc:
            raise APIError.bad_request(exc) from None
        finally:  # one failed (or the client left): the others stop too
            for task in tasks:
                task.cancel()

    def handed_over(self, output: RequestOutput) -> dict | None:
        """The `kv_transfer_params` a prefill's response carries for the decode worker:
        where its blocks wait, its first token and logprobs, signed for the cluster."""
        remote = output.kv_transfer_params
        if remote is None or self.cluster_secret is None:
            return None
        logprobs = output.outputs[0].logprobs
        if logprobs:
            remote = msgspec.structs.replace(
                remote, first_logprobs=[list(entry.items()) for entry in logprobs]
            )
        return {"remote_prefill": msgspec.to_builtins(remote.signed(self.cluster_secret))}

    def chunk(self, kind: str, request_id, created, choices, usage_block=None) -> dict:
        """One streamed object (`kind`: chat.completion.chunk or text_completion)."""
        chunk = {
            "id": request_id,
            "object": kind,
            "created": created,
            "model": self.model_name,
            "choices": choices,
        }
        if usage_block is not None:
            chunk["usage"] = usage_block
        return chunk

    def token_name(self, token_id: int, form: LogprobForm) -> str:
        """A token as its logprobs name it (`form`)."""
        return f"token_id:{token_id}" if form.token_ids else self.token_text(token_id)

    def token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            tokenizer = self.llm.tokenizer
            text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
            self._token_texts[token_id] = text
        return text


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Items of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, stream):
        try:
            async for item in stream:
                await queue.put((index, item))
            await queue.put((index, done))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def top_entries(entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
    """The num_top most likely of an engine logprobs entry (chosen token first, then the
    top alternatives, the chosen one not repeated)."""
    return sorted(entry.items(), key=lambda item: -item[1])[:num_top]


def usage(outputs: list[RequestOutput]) -> dict:
    """OpenAI usage over the final outputs of one API request (one per prompt)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(seq.token_ids) for o in outputs for seq in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class RunningUsage:
    """The usage of a streamed request so far (stream_options.continuous_usage_stats):
    all its prompt tokens from the first chunk on, the completion tokens out by now."""

    def __init__(self, num_prompt_tokens: int) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self._latest: dict[int, RequestOutput] = {}  # per prompt

    def update(self, prompt_index: int, output: RequestOutput) -> None:
        self._latest[prompt_index] = output

    def block(self) -> dict:
        outputs = self._latest.values()
        completion = sum(len(seq.token_ids) for o in outputs for seq in o.outputs)
        cached = sum(max(o.num_cached_tokens, 0) for o in outputs)
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.num_prompt_tokens + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def sse(data: dict) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_error(exc: BaseException) -> bytes:
    """The last event of a stream that failed after it started."""
    if isinstance(exc, ValueError):
        return sse(APIError.bad_request(exc).body())
    if isinstance(exc, EngineDeadError):
        return sse(error_body(503, str(exc) or type(exc).__name__, None, ENGINE_STOPPED))
    logger.error("stream failed", exc_info=exc)
    return sse(error_body(500, "internal error; the request was aborted"))

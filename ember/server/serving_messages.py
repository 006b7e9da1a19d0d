"""POST /v1/messages: the Anthropic Messages API, as a translation of the chat endpoint.

A request becomes the chat request that means the same (`MessagesRequest.to_chat`) and
runs through `ChatServing` unchanged (chat template, tools and their grammars,
admission, metrics). Its answer is translated back: a chat completion into a Message
(text and tool_use blocks, `stop_reason` from the finish reason and the stop string that
matched); the chat chunks of a stream into Anthropic's events, each SSE frame with its
`event:` line:

    message_start            once the first engine output is in (it carries the usage)
    content_block_start      a text, thinking or tool_use block opens (one at a time)
    content_block_delta*     text_delta / thinking_delta / input_json_delta
    content_block_stop
    ...                      the next block
    message_delta            stop_reason, stop_sequence, usage
    message_stop
or `event: error` (Anthropic's error body) when the request fails mid-way.

Usage as Anthropic counts it: `input_tokens` are the prompt tokens not read from the
prefix cache, `cache_read_input_tokens` those that were (the two add up to the prompt),
`cache_creation_input_tokens` is 0 (ember caches every prefix at no extra cost). The
engine outputs behind a streamed chat answer are read through `RequestContext.observe`.

A stream a router moved here (`resume.py`) opens with no `message_start` (the client has
it): the writer takes in the resumed text first (`RequestContext.replayed`), so its
blocks go on with the index and type the client has seen.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections.abc import AsyncIterator

import msgspec
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ember.outputs import RequestOutput
from ember.server.errors import (
    ENGINE_STOPPED,
    ERROR_CODE_HEADER,
    APIError,
    anthropic_error_body,
    describe,
)
from ember.server.protocol_messages import MessagesRequest
from ember.server.resume import STOPPED_MARK, TrailCarry
from ember.server.serving import RequestContext
from ember.server.serving_chat import ChatServing

logger = logging.getLogger("ember.server")
_encode = msgspec.json.Encoder().encode

# how a chat error starts -> how the Messages request says the same
_FIELD_NAMES = {
    "stop": "stop_sequences",
    "parallel_tool_calls: false": "tool_choice.disable_parallel_tool_use: true",
    "user": "metadata.user_id",
}
# the error types of the chat stream's error event -> Anthropic's
_STREAM_ERRORS = {"invalid_request_error": "invalid_request_error",
                  "service_unavailable": "overloaded_error"}  # fmt: skip
# a text block's type -> (how it opens, its delta's type)
_TEXT_BLOCKS = {
    "text": ({"type": "text", "text": ""}, "text_delta"),
    "thinking": ({"type": "thinking", "thinking": "", "signature": ""}, "thinking_delta"),
}


def parse_request(raw: bytes) -> MessagesRequest:
    """The request body, or a 400 saying what is wrong with it."""
    try:
        return MessagesRequest.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first.get("type") == "json_invalid":
            raise APIError(400, "malformed JSON body") from None
        param, message = describe(first)
        raise APIError(400, message, param) from None


def anthropic_error(exc: APIError) -> JSONResponse:
    headers = dict(exc.headers or {})
    if exc.code is not None:
        headers[ERROR_CODE_HEADER] = exc.code
    body = anthropic_error_body(exc.status, exc.message)
    return JSONResponse(body, status_code=exc.status, headers=headers)


class MessagesServing:
    """Serves /v1/messages through a ChatServing."""

    def __init__(self, chat: ChatServing, reasoning: bool = False) -> None:
        self.chat = chat
        # the hook for `thinking`: true once the chat path has a reasoning parser for the
        # model (its `reasoning_content` comes back as thinking blocks)
        self.reasoning = reasoning

    async def create(
        self, request: MessagesRequest, ctx: RequestContext
    ) -> dict | AsyncIterator[bytes]:
        try:
            chat_request = request.to_chat(self.reasoning)
        except ValueError as exc:
            raise APIError.bad_request(exc) from None
        engine = _EngineView()
        writer = _EventWriter(self.chat.model_name, engine, resumed=ctx.resume is not None)
        ctx = dataclasses.replace(ctx, observe=engine, replayed=writer.write)  # events dropped
        try:
            answer = await self.chat.create(chat_request, ctx)
        except APIError as exc:
            raise _renamed(exc) from None
        if isinstance(answer, dict):
            return message_of(answer)
        return _events(answer, writer)


class _EngineView:
    """The engine outputs of one streamed request, as the chat endpoint sees them."""

    def __init__(self) -> None:
        self.last: RequestOutput | None = None

    def __call__(self, output: RequestOutput) -> None:
        self.last = output

    def usage(self) -> dict:
        last = self.last
        if last is None:
            return _usage(0, 0, 0)
        num_output = len(last.outputs[0].token_ids) if last.outputs else 0
        return _usage(len(last.prompt_token_ids), last.num_cached_tokens, num_output)

    def stop_string(self) -> str | None:
        if self.last is None or not self.last.outputs:
            return None
        reason = self.last.outputs[0].stop_reason
        return reason if isinstance(reason, str) else None


def message_of(completion: dict) -> dict:
    """The Anthropic Message for a (non-streamed) chat completion."""
    choice = completion["choices"][0]
    message = choice["message"]
    content = []
    if message.get("reasoning_content"):
        content.append({"type": "thinking", "thinking": message["reasoning_content"],
                        "signature": ""})  # fmt: skip
    if message.get("content"):
        content.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        function = call["function"]
        content.append({"type": "tool_use", "id": _tool_use_id(call["id"]),
                        "name": function["name"], "input": _input(function["arguments"])})  # fmt: skip
    stop = choice.get("stop_reason")
    stop_reason, stop_sequence = _stop(choice["finish_reason"], stop)
    usage = completion["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {
        "id": _message_id(completion["id"]),
        "type": "message",
        "role": "assistant",
        "model": completion["model"],
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage(usage["prompt_tokens"], cached, usage["completion_tokens"]),
    }


async def _events(chunks: AsyncIterator[bytes], writer: _EventWriter) -> AsyncIterator[bytes]:
    """Anthropic's events for a stream of chat chunks (SSE frames), each chat frame's
    token trail (a router's) on the first event written for it or after it."""
    trail = TrailCarry()
    async for frame in chunks:
        chunk = _decode(trail.take(frame))
        if chunk is None:
            continue
        for event in trail.put(writer.write(chunk)):
            yield event
        if writer.done:
            return


class _EventWriter:
    """Turns the chat chunks of one streamed answer into Anthropic's events."""

    def __init__(self, model: str, engine: _EngineView, resumed: bool = False) -> None:
        self.model = model
        self.engine = engine
        self.started = resumed  # message_start sent (by another worker, on a moved stream)
        self.index = -1  # of the open block, or of the last one
        self.open: str | None = None  # the open block's type
        self.done = False

    def write(self, chunk: dict) -> list[bytes]:
        if "error" in chunk:
            self.done = True
            error = chunk["error"]
            kind = _STREAM_ERRORS.get(error.get("type"), "api_error")
            body = {"type": "error", "error": {"type": kind, "message": error.get("message")}}
            mark = STOPPED_MARK if error.get("code") == ENGINE_STOPPED else b""
            return [mark + _frame("error", body)]
        if not chunk["choices"]:  # a usage chunk
            return []
        choice = chunk["choices"][0]
        delta, finish = choice["delta"], choice.get("finish_reason")
        reasoning, text = delta.get("reasoning_content"), delta.get("content")
        calls = delta.get("tool_calls") or []
        if not (reasoning or text or calls or finish):  # the first chunk, naming the role
            return []
        events = [] if self.started else self._start(chunk["id"])
        if reasoning:
            events += self._text("thinking", reasoning)
        if text:
            events += self._text("text", text)
        for call in calls:
            events += self._tool_call(call)
        if finish is not None:
            events += self._finish(finish)
        return events

    def _start(self, chat_id: str) -> list[bytes]:
        self.started = True
        message = {"id": _message_id(chat_id), "type": "message", "role": "assistant",
                   "model": self.model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": self.engine.usage()}  # fmt: skip
        return [_frame("message_start", {"type": "message_start", "message": message})]

    def _text(self, kind: str, text: str) -> list[bytes]:
        """A piece of text (kind: text or thinking), in a block of its kind."""
        empty, delta_type = _TEXT_BLOCKS[kind]
        events = self._open(dict(empty)) if self.open != kind else []
        return [*events, self._delta({"type": delta_type, kind: text})]

    def _tool_call(self, call: dict) -> list[bytes]:
        events = []
        function = call.get("function") or {}
        if call.get("id"):  # a new call
            block = {"type": "tool_use", "id": _tool_use_id(call["id"]),
                     "name": function.get("name"), "input": {}}  # fmt: skip
            events += self._open(block)
        if function.get("arguments"):
            events.append(self._delta({"type": "input_json_delta",
                                       "partial_json": function["arguments"]}))  # fmt: skip
        return events

    def _open(self, block: dict) -> list[bytes]:
        events = self._close()
        self.index += 1
        self.open = block["type"]
        body = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, _frame("content_block_start", body)]

    def _delta(self, delta: dict) -> bytes:
        body = {"type": "content_block_delta", "index": self.index, "delta": delta}
        return _frame("content_block_delta", body)

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_frame("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _finish(self, finish_reason: str) -> list[bytes]:
        self.done = True
        stop_reason, stop_sequence = _stop(finish_reason, self.engine.stop_string())
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        body = {"type": "message_delta", "delta": delta, "usage": self.engine.usage()}
        return [*self._close(), _frame("message_delta", body),
                _frame("message_stop", {"type": "message_stop"})]  # fmt: skip


def _decode(frame: bytes) -> dict | None:
    """The chunk in one SSE frame of the chat stream (None for `[DONE]`)."""
    if not frame.startswith(b"data: {"):
        return None
    return msgspec.json.decode(frame[6:])


def _frame(event: str, body: dict) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + _encode(body) + b"\n\n"


def _stop(finish_reason: str | None, stop_string: str | int | None) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) for a chat finish reason and the engine's stop reason."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stop_string, str):
        return "stop_sequence", stop_string
    return "end_turn", None


def _usage(num_prompt: int, num_cached: int, num_output: int) -> dict:
    return {
        "input_tokens": num_prompt - num_cached,
        "output_tokens": num_output,
        "cache_read_input_tokens": num_cached,
        "cache_creation_input_tokens": 0,
    }


def _input(arguments: str) -> dict:
    """A tool call's arguments as the tool_use block's input ({} when they were cut short
    by max_tokens and do not parse)."""
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _message_id(chat_id: str) -> str:
    return "msg_" + chat_id.removeprefix("chatcmpl-")


def _tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _renamed(exc: APIError) -> APIError:
    """The chat endpoint's error, naming the field as the Messages request calls it."""
    for chat_name, name in _FIELD_NAMES.items():
        if re.match(rf"{re.escape(chat_name)}\b", exc.message):
            exc.message = name + exc.message[len(chat_name) :]
            exc.param = name.split(":")[0]
            break
    return exc

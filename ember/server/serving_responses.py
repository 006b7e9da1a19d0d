"""POST /v1/responses and GET /v1/responses/{id}: the OpenAI Responses API, a thin
translation onto the chat path.

A request becomes one chat request (`protocol_responses`): the system message from
`instructions`, the conversation of `previous_response_id` (from the store), then the
input items. `ChatServing` runs it; its answer becomes the response's output items (a
`message` with `output_text`, and one `function_call` item per tool call), its usage the
response's usage (`input_tokens_details.cached_tokens` from ember's prefix cache). A
streamed answer is read chunk by chunk and re-told as the Responses API's semantic
events (`response.created` ... `response.completed`, each with its `sequence_number`).
Output item ids are the response's id and the item's place, and tool-call ids are drawn
from the response's id, so a stream a router moved to another worker (`resume.py`) goes
on naming what its client has seen, numbering events on from the last one it had.

The store keeps, per stored response, only what that turn added (its input messages and
its output) and the id of the turn before, so a conversation of N turns costs N turns of
text, not N^2; the oldest responses go once the store holds more than `max_chars`
characters. A conversation whose earlier turn is gone can no longer be continued (404).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import ValidationError

from ember.server.errors import ENGINE_STOPPED, APIError, describe
from ember.server.limits import DEFAULT_STORE_CHARS
from ember.server.protocol import ChatCompletionRequest
from ember.server.protocol_responses import ResponsesRequest, chat_messages
from ember.server.resume import STOPPED_MARK, TrailCarry
from ember.server.serving import RequestContext, now
from ember.server.serving_chat import ChatServing


@dataclass
class _Turn:
    previous_id: str | None
    messages: list[dict]  # what this turn added: its input and its output, as chat messages
    response: dict
    size: int


class ResponseStore:
    """Stored responses by id, oldest first; bounded by the characters they hold."""

    def __init__(self, max_chars: int = DEFAULT_STORE_CHARS) -> None:
        self.max_chars = max_chars
        self._turns: OrderedDict[str, _Turn] = OrderedDict()
        self._size = 0

    def get(self, response_id: str) -> dict | None:
        turn = self._turns.get(response_id)
        return None if turn is None else turn.response

    def conversation(self, response_id: str) -> list[dict] | None:
        """The chat messages up to and including that response (None if any turn is gone)."""
        turns = []
        while response_id is not None:
            turn = self._turns.get(response_id)
            if turn is None:
                return None
            turns.append(turn)
            response_id = turn.previous_id
        return [m for turn in reversed(turns) for m in turn.messages]

    def put(self, response: dict, previous_id: str | None, messages: list[dict]) -> None:
        size = len(json.dumps(messages))
        self._turns[response["id"]] = _Turn(previous_id, messages, response, size)
        self._size += size
        while self._size > self.max_chars and len(self._turns) > 1:
            _, oldest = self._turns.popitem(last=False)
            self._size -= oldest.size


class ResponsesServing:
    def __init__(self, chat: ChatServing, store: ResponseStore | None = None) -> None:
        self.chat = chat
        self.store = store or ResponseStore()

    def retrieve(self, response_id: str) -> dict:
        response = self.store.get(response_id)
        if response is None:
            raise _not_found(response_id)
        return response

    async def create(
        self, request: ResponsesRequest, ctx: RequestContext, response_id: str
    ) -> dict | AsyncIterator[bytes]:
        model_name = self.chat.model_name
        turn = _Pending(request, response_id, self._history(request), model_name)
        events = _EventWriter(turn)
        if ctx.resume is not None:  # a stream moved here: it goes on where the client is
            turn.created_at = ctx.resume.created
            events.sequence = ctx.resume.events
        # the chat request goes under the response's id: its tool-call ids are drawn from
        # it, so a moved stream's come out the same
        ctx = dataclasses.replace(ctx, request_id=response_id, replayed=events.replay)
        result = await self.chat.create(turn.chat_request(), ctx)
        if isinstance(result, dict):
            choice = result["choices"][0]
            items = _output_items(choice["message"], choice["finish_reason"], response_id)
            response = turn.response(items, choice["finish_reason"], _usage(result["usage"]))
            self._keep(turn, response, choice["message"])
            return response
        return self._stream(turn, events, result)

    def _history(self, request: ResponsesRequest) -> list[dict]:
        try:
            request.check_supported()
        except ValueError as exc:
            raise APIError.bad_request(exc) from None
        if request.previous_response_id is None:
            return []
        messages = self.store.conversation(request.previous_response_id)
        if messages is None:
            raise _not_found(request.previous_response_id, "previous_response_id")
        return messages

    def _keep(self, turn: _Pending, response: dict, message: dict) -> None:
        if turn.request.store:
            output = {"role": "assistant", "content": message.get("content")}
            if message.get("tool_calls"):
                output["tool_calls"] = message["tool_calls"]
            previous = turn.request.previous_response_id
            self.store.put(response, previous, [*turn.new_messages, output])

    async def _stream(
        self, turn: _Pending, events: _EventWriter, chunks: AsyncIterator[bytes]
    ) -> AsyncIterator[bytes]:
        """The events; each chat frame's token trail (a router's) on the first event
        written for it or after it. A moved stream goes on from the event its client has
        had last (its first two too, if it had not had them)."""
        trail = TrailCarry()
        if events.sequence == 0:
            yield events.emit("response.created", response=turn.response([], None, None))
        if events.sequence == 1:
            yield events.emit("response.in_progress", response=turn.response([], None, None))
        async for raw in chunks:
            for chunk in _chunks_of(trail.take(raw)):
                if "error" in chunk:
                    failed = events.emit("response.failed", response=events.failed(chunk["error"]))
                    stopped = chunk["error"].get("code") == ENGINE_STOPPED
                    yield (STOPPED_MARK if stopped else b"") + failed
                    return
                frames = events.feed(chunk)
                if events.finish_reason is not None:  # the last text, with the last events
                    trail.hold_rest()
                for frame in trail.put(frames):
                    yield frame
        frames = events.close()
        response = events.final()
        self._keep(turn, response, events.message())
        kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
        for frame in trail.put([*frames, events.emit(kind, response=response)], last=True):
            yield frame


class _Pending:
    """One Responses request on its way through the chat path."""

    def __init__(
        self, request: ResponsesRequest, response_id: str, history: list[dict], model: str
    ) -> None:
        self.request = request
        self.id = response_id
        self.model = model
        self.created_at = now()
        self.new_messages = chat_messages(request.input_items())
        system = [{"role": "system", "content": request.instructions}]
        self.messages = (system if request.instructions else []) + history + self.new_messages

    def chat_request(self) -> ChatCompletionRequest:
        body = {"messages": self.messages, **self.request.chat_fields()}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            param, message = describe(exc.errors()[0])
            raise APIError(400, message, param, "invalid_value") from None

    def response(self, output: list[dict], finish_reason: str | None, usage: dict | None):
        request = self.request
        done = finish_reason is not None
        incomplete = finish_reason == "length"
        status = "incomplete" if incomplete else "completed" if done else "in_progress"
        tool_choice = request.tool_choice or ("auto" if request.tools else "none")
        if not isinstance(tool_choice, str):
            tool_choice = tool_choice.model_dump()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "instructions": request.instructions,
            "max_output_tokens": request.max_output_tokens,
            "model": self.model,
            "output": output,
            "parallel_tool_calls": request.parallel_tool_calls is not False,
            "previous_response_id": request.previous_response_id,
            "store": request.store,
            "temperature": request.temperature,
            "top_p": request.top_p,
            "text": {"format": {"type": "text"}},
            "tool_choice": tool_choice,
            "tools": [t.model_dump(exclude_none=True) for t in request.tools or []],
            "usage": usage,
            "metadata": request.metadata or {},
            "user": request.user,
        }


class _EventWriter:
    """Chat stream chunks in, Responses API events out (SSE frames)."""

    def __init__(self, turn: _Pending) -> None:
        self.turn = turn
        self.sequence = 0
        self.output: list[dict] = []
        self.text_item: dict | None = None  # the open message or reasoning item
        self.text = ""  # ... and its text so far
        self.calls: dict[int, dict] = {}  # chat tool-call index -> its function_call item
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def replay(self, chunk: dict) -> None:
        """Takes in a moved stream's resumed text (the client has had its events)."""
        sequence = self.sequence
        self.feed(chunk)
        self.sequence = sequence

    def emit(self, kind: str, **fields) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(event)}\n\n".encode()

    def feed(self, chunk: dict) -> list[bytes]:
        if chunk.get("usage"):
            self.usage = _usage(chunk["usage"])
        frames: list[bytes] = []
        for choice in chunk.get("choices", []):
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                frames += self._text("reasoning", delta["reasoning_content"])
            if delta.get("content"):
                frames += self._text("message", delta["content"])
            for call in delta.get("tool_calls") or []:
                frames += self._call(call)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason
        return frames

    def _text(self, kind: str, text: str) -> list[bytes]:
        """A piece of the answer's text (kind "message") or of its reasoning ("reasoning")."""
        frames = []
        if self.text_item is not None and self.text_item["type"] != kind:
            frames += self._close_text()
        if self.text_item is None:
            self.text_item = _TEXT_ITEMS[kind](_item_id(kind, self.turn.id, len(self.output)))
            frames.append(self._added(self.text_item))
            if kind == "message":
                part = {"type": "output_text", "text": "", "annotations": []}
                at = self._at(self.text_item)
                frames.append(self.emit("response.content_part.added", **at, part=part))
        self.text += text
        event = "response.output_text.delta" if kind == "message" else _REASONING_DELTA
        extra = {"logprobs": []} if kind == "message" else {}
        frames.append(self.emit(event, **self._at(self.text_item), delta=text, **extra))
        return frames

    def _call(self, call: dict) -> list[bytes]:
        frames = self._close_text()
        item = self.calls.get(call["index"])
        function = call.get("function") or {}
        if item is None:
            item_id = _item_id("function_call", self.turn.id, len(self.output))
            item = {"type": "function_call", "id": item_id, "call_id": call.get("id"),
                    "name": function.get("name"), "arguments": "", "status": "in_progress"}  # fmt: skip
            self.calls[call["index"]] = item
            frames.append(self._added(item))
        if function.get("arguments"):
            item["arguments"] += function["arguments"]
            frames.append(self.emit("response.function_call_arguments.delta",
                                    item_id=item["id"], output_index=self._index(item),
                                    delta=function["arguments"]))  # fmt: skip
        return frames

    def close(self) -> list[bytes]:
        frames = self._close_text()
        status = self._item_status()
        for item in self.calls.values():
            item["status"] = status
            frames.append(self.emit("response.function_call_arguments.done", item_id=item["id"],
                                    output_index=self._index(item), arguments=item["arguments"]))  # fmt: skip
            frames.append(self.emit("response.output_item.done", output_index=self._index(item),
                                    item=item))  # fmt: skip
        return frames

    def _close_text(self) -> list[bytes]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        text, self.text = self.text, ""
        item["status"] = self._item_status()
        at, done = self._at(item), self.emit
        if item["type"] == "reasoning":
            item["content"] = [{"type": "reasoning_text", "text": text}]
            return [
                done("response.reasoning_text.done", **at, text=text),
                done("response.output_item.done", output_index=at["output_index"], item=item),
            ]
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item["content"] = [part]
        return [
            done("response.output_text.done", **at, text=text, logprobs=[]),
            done("response.content_part.done", **at, part=part),
            done("response.output_item.done", output_index=at["output_index"], item=item),
        ]

    def _added(self, item: dict) -> bytes:
        self.output.append(item)
        return self.emit("response.output_item.added", output_index=self._index(item), item=item)

    def _index(self, item: dict) -> int:
        return next(i for i, x in enumerate(self.output) if x is item)

    def _at(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self._index(item), "content_index": 0}

    def _item_status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    def final(self) -> dict:
        return self.turn.response(self.output, self.finish_reason or "stop", self.usage)

    def failed(self, error: dict) -> dict:
        response = self.turn.response(self.output, None, self.usage)
        response["status"] = "failed"
        response["error"] = {"code": error.get("code") or "server_error",
                             "message": error.get("message", "")}  # fmt: skip
        return response

    def message(self) -> dict:
        """The assistant's turn as a chat message (for the store)."""
        text = "".join(p["text"] for i in self.output if i["type"] == "message"
                       for p in i["content"])  # fmt: skip
        calls = [{"id": i["call_id"], "type": "function",
                  "function": {"name": i["name"], "arguments": i["arguments"]}}
                 for i in self.output if i["type"] == "function_call"]  # fmt: skip
        return {"content": text or None, "tool_calls": calls or None}


_REASONING_DELTA = "response.reasoning_text.delta"
_TEXT_ITEMS = {
    "message": lambda item_id: {"type": "message", "id": item_id, "status": "in_progress",
                                "role": "assistant", "content": []},
    "reasoning": lambda item_id: {"type": "reasoning", "id": item_id, "status": "in_progress",
                                  "summary": [], "content": []},
}  # fmt: skip
_ITEM_PREFIXES = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


def _chunks_of(raw: bytes) -> list[dict]:
    """The JSON objects of chat SSE frames (`data: {...}`; [DONE] and blanks skipped)."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            out.append(json.loads(line[6:]))
    return out


def _output_items(message: dict, finish_reason: str | None, response_id: str) -> list[dict]:
    status = "incomplete" if finish_reason == "length" else "completed"
    items = []
    if message.get("reasoning_content"):
        content = [{"type": "reasoning_text", "text": message["reasoning_content"]}]
        items.append({"type": "reasoning", "id": _item_id("reasoning", response_id, len(items)),
                      "status": status, "summary": [], "content": content})  # fmt: skip
    if message.get("content"):
        part = {"type": "output_text", "text": message["content"], "annotations": [],
                "logprobs": []}  # fmt: skip
        items.append({"type": "message", "id": _item_id("message", response_id, len(items)),
                      "status": status, "role": "assistant", "content": [part]})  # fmt: skip
    for call in message.get("tool_calls") or []:
        item_id = _item_id("function_call", response_id, len(items))
        items.append({"type": "function_call", "id": item_id, "call_id": call["id"],
                      "name": call["function"]["name"],
                      "arguments": call["function"]["arguments"], "status": status})  # fmt: skip
    return items


def _usage(chat_usage: dict) -> dict:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": chat_usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": chat_usage["total_tokens"],
    }


def _item_id(kind: str, response_id: str, index: int) -> str:
    """The id of the response's output item at `index` (the same on any worker, so a
    moved stream goes on naming the items its client has seen)."""
    return f"{_ITEM_PREFIXES[kind]}_{response_id.removeprefix('resp_')}_{index}"


def new_response_id() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"no stored response with id {response_id!r}", param, "not_found")

"""POST /v1/chat/completions: chat template in, assistant message (or SSE deltas) out.

Each choice's text goes through a `_ChoiceText` that knows the request's `ToolPlan`, so
the streamed and the non-streamed answers are built by the same code: the model's
reasoning and its answer split by the served model's parsers (`ember.server.parsers`),
tool calls parsed out of the answer in the model's format (auto), a JSON array of calls
(required), or the named function's arguments streamed as they are generated.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

from ember.outputs import CompletionOutput
from ember.server.chat import ToolPlan, parse_required_calls, render_prompt, tool_plan
from ember.server.errors import APIError
from ember.server.parsers import ChatParsers, OutputParser, ParsedText, merge_calls, resolve_parsers
from ember.server.parsers.base import ToolCallDelta, new_call_id
from ember.server.protocol import ChatCompletionRequest
from ember.server.resume import TokenTrail
from ember.server.serving import (
    SSE_DONE,
    LogprobForm,
    RequestContext,
    RunningUsage,
    ServingBase,
    new_id,
    now,
    sse,
    sse_error,
    top_entries,
    usage,
)


class _ChoiceText:
    """Turns one sequence's text, piece by piece, into reasoning, content and tool calls."""

    def __init__(
        self,
        plan: ToolPlan,
        parser: OutputParser | None,
        ids: random.Random | None = None,
        keep_reasoning: bool = True,
    ) -> None:
        self.plan = plan
        self.keep_reasoning = keep_reasoning  # vLLM's include_reasoning: false drops it
        self.parser = parser  # none / auto: the served model's reasoning and tool parsers
        self.ids = ids  # the choice's tool-call ids are drawn from it
        if parser is not None and parser.tools is not None:
            parser.tools.call_ids = ids
        self.required_text = ""
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> ParsedText:
        """What this piece adds; call with finished=True once."""
        mode = self.plan.mode
        if mode == "named":
            out = ParsedText()
            if self.num_calls == 0:
                out.calls.append(ToolCallDelta(0, new_call_id(self.ids), self.plan.function))
            if text:
                out.calls.append(ToolCallDelta(0, arguments=text))
        elif mode == "required":
            self.required_text += text
            calls = parse_required_calls(self.required_text) if finished else []
            out = ParsedText(
                calls=[ToolCallDelta(i, new_call_id(self.ids), *c) for i, c in enumerate(calls)]
            )
        elif self.parser is not None:
            out = self.parser.feed(text)
            if finished:
                out.add(self.parser.finish())
        else:
            out = ParsedText(content=text)
        if self.plan.max_calls is not None:  # parallel_tool_calls: false
            out.calls = [c for c in out.calls if c.index < self.plan.max_calls]
        self.num_calls += sum(c.id is not None for c in out.calls)
        if not self.keep_reasoning:
            out.reasoning = ""
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason


class ChatServing(ServingBase):
    def __init__(self, *args, parsers: ChatParsers | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # the served model's tool-call and reasoning parsers (by default: from its template)
        self.parsers = parsers or resolve_parsers(self.llm.tokenizer)

    async def create(
        self, request: ChatCompletionRequest, ctx: RequestContext
    ) -> dict | AsyncIterator[bytes]:
        self.check_model(request.model)
        try:
            params = request.to_sampling_params()
            plan = tool_plan(request)
            text = await asyncio.to_thread(render_prompt, self.llm.tokenizer, request, plan)
        except ValueError as exc:
            raise APIError.bad_request(exc) from None
        # the rendered template holds the model's special tokens already (unless
        # add_special_tokens asks for the tokenizer's too, as vLLM's does)
        special = request.add_special_tokens
        prompt = await self.check_prompt(
            text, params, "messages", add_special_tokens=special, truncation=request.truncation()
        )
        # a moved stream goes on under its id; an API layered on this one may name it
        request_id = ctx.resume.id if ctx.resume else ctx.request_id or new_id("chatcmpl")
        texts = self._choice_texts(request, plan, text, params.n, request_id)
        if texts[0].parser is not None and self.parsers.keep_special_tokens:
            params.skip_special_tokens = False  # the parsers' markers are special tokens
        engine_id = request_id if ctx.resume is None else new_id("chatcmpl")  # each its own
        (stream,) = self.start({engine_id: prompt}, params, ctx, plan.grammar)
        if request.stream:
            running = (
                RunningUsage(len(prompt.prompt_token_ids)) if request.continuous_usage else None
            )
            return self._stream(request, request_id, params, texts, stream, ctx, running)
        (final,) = await self.collect([stream])
        form = LogprobForm.of(request, params)
        response = {
            "id": request_id,
            "object": "chat.completion",
            "created": now(),
            "model": self.model_name,
            "choices": [self._choice(seq, texts[seq.index], form) for seq in final.outputs],
            "usage": usage([final]),
        }
        if (kv := self.handed_over(final)) is not None:
            response["kv_transfer_params"] = kv
        return response

    def _choice_texts(
        self, request, plan: ToolPlan, prompt: str, n: int, request_id: str
    ) -> list[_ChoiceText]:
        """One per choice, with an `OutputParser` where the served model's parsers read
        the text: tool calls with tool_choice auto, reasoning unless a grammar holds the
        output (a forced tool choice, response_format). Tool-call ids are drawn from the
        request's id and the choice's index (a moved stream's come out the same)."""
        tools = request.tools if plan.mode == "auto" else None
        reasoning = plan.grammar is None and self.parsers.reasoning is not None
        parses = plan.mode in ("auto", "none") and bool(tools or reasoning)
        return [
            _ChoiceText(
                plan,
                self.parsers.output_parser(prompt, tools, reasoning) if parses else None,
                random.Random(f"{request_id}/{index}"),
                request.include_reasoning,
            )
            for index in range(n)
        ]

    def _choice(self, seq: CompletionOutput, text: _ChoiceText, form: LogprobForm) -> dict:
        parsed = text.feed(seq.text, finished=True)
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            message["tool_calls"] = merge_calls(parsed.calls)
            message["content"] = parsed.content if parsed.content.strip() else None
        return {
            "index": seq.index,
            "message": message,
            "logprobs": self._logprobs(seq.logprobs, form),
            "finish_reason": text.finish_reason(seq.finish_reason),
            "stop_reason": seq.stop_reason,
        }

    def _logprobs(self, entries: list[dict[int, float]] | None, form: LogprobForm) -> dict | None:
        if entries is None:
            return None
        content = []
        for entry in entries:
            (chosen, value), *_ = entry.items()
            top = [self._token_logprob(t, v, form) for t, v in top_entries(entry, form.top)]
            content.append(dict(self._token_logprob(chosen, value, form), top_logprobs=top))
        return {"content": content}

    def _token_logprob(self, token_id: int, value: float, form: LogprobForm) -> dict:
        text = self.token_name(token_id, form)
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    async def _stream(
        self, request, request_id, params, texts, stream, ctx: RequestContext, running=None
    ) -> AsyncIterator[bytes]:
        """The SSE events; a resumed stream (`resume.py`) goes on from its resumed tokens
        under its first worker's id, without a role chunk."""
        resume = ctx.resume
        created = now() if resume is None else resume.created
        n, form = params.n, LogprobForm.of(request, params)
        trail = TokenTrail(ctx.trail and n == 1, 0 if resume is None else len(resume.token_ids))
        replaying = resume is not None and bool(resume.token_ids)
        ended: set[int] = set()

        def chunk(index, delta, finish=None, logprobs=None, kv=None, token_ids=(), more=0):
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
            body = self.chunk("chat.completion.chunk", request_id, created, [choice])
            if running is not None:
                body["usage"] = running.block()
            if kv is not None:
                body["kv_transfer_params"] = kv
            return trail.mark(sse(body), token_ids, more)

        for i in range(n if resume is None else 0):
            yield chunk(i, {"role": "assistant", "content": ""})
        final = None
        try:
            async for final in stream:
                if running is not None:
                    running.update(0, final)
                if replaying:  # the resumed tokens: their text was sent by another worker
                    replaying = False
                    for seq in final.outputs:
                        text = texts[seq.index]
                        delta = _delta(text.feed(seq.delta_text, False))
                        if ctx.replayed is not None and delta:  # an API layered on this one
                            choice = {"index": seq.index, "delta": delta, "finish_reason": None}
                            ctx.replayed({"id": request_id, "choices": [choice]})
                        if seq.finished:  # they had ended it: only the finish chunk is due
                            ended.add(seq.index)
                            yield chunk(seq.index, {}, text.finish_reason(seq.finish_reason))
                    continue
                for seq in final.outputs:
                    if seq.index in ended or not (seq.delta_text or seq.finished):
                        continue
                    text = texts[seq.index]
                    delta = _delta(text.feed(seq.delta_text, seq.finished))
                    logprobs = self._logprobs(seq.delta_logprobs, form)
                    if delta or logprobs:  # with the finish_reason after it: one unit
                        more = int(seq.finished)
                        yield chunk(seq.index, delta, logprobs=logprobs, token_ids=seq.token_ids,
                                    more=more)  # fmt: skip
                    if seq.finished:
                        ended.add(seq.index)
                        reason = text.finish_reason(seq.finish_reason)
                        kv = self.handed_over(final)
                        yield chunk(seq.index, {}, reason, kv=kv, token_ids=seq.token_ids)
        except Exception as exc:  # noqa: BLE001 - the stream ends with an error event
            yield sse_error(exc)
            yield SSE_DONE
            return
        if request.include_usage and final is not None:
            yield sse(self.chunk("chat.completion.chunk", request_id, created, [], usage([final])))
        yield SSE_DONE


def _delta(parsed) -> dict:
    """A stream chunk's delta for a piece of parsed output."""
    delta: dict = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls:
        delta["tool_calls"] = [c.to_openai() for c in parsed.calls]
    return delta

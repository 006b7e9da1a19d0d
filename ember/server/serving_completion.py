"""POST /v1/completions: one engine request per prompt, choices indexed prompt * n + i.

With `echo` a choice's text starts with its prompt and, with `logprobs`, its logprobs with
the prompt tokens' (the first one null: nothing predicts it), as OpenAI's legacy API did;
with vLLM's `prompt_logprobs` the choice carries vLLM's `prompt_logprobs` list. Streamed,
both come with a choice's first chunk.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from ember.outputs import CompletionOutput, RequestOutput
from ember.server.chat import response_format_grammar
from ember.server.errors import APIError
from ember.server.protocol import CompletionRequest
from ember.server.resume import TokenTrail
from ember.server.serving import (
    SSE_DONE,
    LogprobForm,
    RequestContext,
    RunningUsage,
    ServingBase,
    merge,
    new_id,
    now,
    sse,
    sse_error,
    top_entries,
    usage,
)


class CompletionServing(ServingBase):
    async def create(
        self, request: CompletionRequest, ctx: RequestContext
    ) -> dict | AsyncIterator[bytes]:
        self.check_model(request.model)
        try:
            params = request.to_sampling_params()
            prompts = request.prompts()
            grammar = response_format_grammar(request.response_format)
        except ValueError as exc:
            raise APIError.bad_request(exc) from None
        if ctx.kv_transfer is not None and len(prompts) != 1:
            raise APIError(400, "kv_transfer_params needs exactly one prompt", "prompt")
        if ctx.resume is not None:
            if len(prompts) != 1:
                raise APIError(400, "resume_params needs exactly one prompt", "prompt")
            params.prompt_logprobs = None  # sent with the stream's first chunk already
        special, truncation = request.add_special_tokens, request.truncation()
        processed = [
            await self.check_prompt(p, params, "prompt", special, truncation) for p in prompts
        ]
        request_id = new_id("cmpl")
        prompts_by_id = {f"{request_id}-{i}": p for i, p in enumerate(processed)}
        streams = self.start(prompts_by_id, params, ctx, grammar)
        if request.stream:
            num_prompt_tokens = sum(len(p.prompt_token_ids) for p in processed)
            running = RunningUsage(num_prompt_tokens) if request.continuous_usage else None
            return self._stream(request, request_id, params, streams, ctx, running)
        finals = await self.collect(streams)
        form = LogprobForm.of(request, params)
        choices = [
            self._choice(
                i * params.n + seq.index, seq, seq.text, seq.logprobs, seq.finish_reason, form
            )
            | self._prompt_parts(request, final, seq.text, seq.logprobs, form)
            for i, final in enumerate(finals)
            for seq in final.outputs
        ]
        response = {
            "id": request_id,
            "object": "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(finals),
        }
        if (kv := self.handed_over(finals[0])) is not None:
            response["kv_transfer_params"] = kv
        return response

    def _choice(self, index, seq: CompletionOutput, text, logprobs, finish_reason, form):
        return {
            "index": index,
            "text": text,
            "logprobs": None if logprobs is None else self._logprobs(logprobs, form),
            "finish_reason": finish_reason,
            "stop_reason": seq.stop_reason if finish_reason else None,
        }

    def _prompt_parts(self, request, output: RequestOutput, text, logprobs, form) -> dict:
        """What a choice's first appearance holds of its prompt (echo, prompt_logprobs), in
        place of its `text` and `logprobs`."""
        parts: dict = {}
        if request.echo:
            parts["text"] = self._prompt_text(output) + text
            if logprobs is not None:
                ids, entries = output.prompt_token_ids, output.prompt_logprobs
                first = {"tokens": [self.token_name(ids[0], form)], "token_logprobs": [None]}
                first["top_logprobs"] = [None]
                prompt = self._logprobs(entries[1:], form)
                tail = self._logprobs(logprobs, form)
                parts["logprobs"] = {k: first[k] + prompt[k] + tail[k] for k in first}
        if request.prompt_logprobs is not None:
            parts["prompt_logprobs"] = self._vllm_prompt_logprobs(output, request.prompt_logprobs)
        return parts

    def _prompt_text(self, output: RequestOutput) -> str:
        if output.prompt is not None:
            return output.prompt
        tokenizer = self.llm.tokenizer
        return tokenizer.decode(output.prompt_token_ids) if tokenizer is not None else ""

    def _vllm_prompt_logprobs(self, output: RequestOutput, num_top: int) -> list[dict | None]:
        """vLLM's shape: per prompt token, {token id: {logprob, rank, decoded_token}} for
        the prompt's token (its rank) and then the top-N (ranks 1..N); null for the first."""
        out: list[dict | None] = [None]
        for entry, rank in zip(
            output.prompt_logprobs[1:], output.prompt_logprob_ranks[1:], strict=True
        ):
            (chosen, value), *_ = entry.items()
            item = {str(chosen): self._vllm_logprob(chosen, value, rank)}
            for position, (token, logprob) in enumerate(top_entries(entry, num_top), 1):
                item.setdefault(str(token), self._vllm_logprob(token, logprob, position))
            out.append(item)
        return out

    def _vllm_logprob(self, token_id: int, value: float, rank: int) -> dict:
        return {"logprob": value, "rank": rank, "decoded_token": self.token_text(token_id)}

    def _logprobs(self, entries: list[dict[int, float]], form: LogprobForm) -> dict:
        tokens, token_logprobs, top = [], [], []
        for entry in entries:
            (chosen, value), *_ = entry.items()
            tokens.append(self.token_name(chosen, form))
            token_logprobs.append(value)
            alternatives: dict[str, float] = {}
            for token, logprob in top_entries(entry, form.top):  # best first; texts may repeat
                alternatives.setdefault(self.token_name(token, form), logprob)
            top.append(alternatives)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top}

    async def _stream(
        self, request, request_id, params, streams, ctx: RequestContext, running
    ) -> AsyncIterator[bytes]:
        """The SSE events; a resumed stream (`resume.py`) goes on from its resumed tokens
        under its first worker's id, its prompt parts not sent again."""
        resume = ctx.resume
        created = now() if resume is None else resume.created
        request_id = request_id if resume is None else resume.id
        n, form = params.n, LogprobForm.of(request, params)
        one = n == 1 and len(streams) == 1
        trail = TokenTrail(ctx.trail and one, 0 if resume is None else len(resume.token_ids))
        replaying = resume is not None and bool(resume.token_ids)
        finals: dict[int, RequestOutput] = {}
        ended: set[int] = set()  # choices whose finish_reason was sent
        # choices that had a chunk (with the prompt parts)
        started: set[int] = set() if resume is None else {0}
        try:
            async for prompt_index, output in merge(streams):
                if running is not None:
                    running.update(prompt_index, output)
                if replaying:  # the resumed tokens: their text was sent by another worker
                    replaying = False
                    if output.finished:  # they had ended it: only the finish is due
                        seq = output.outputs[0]
                        finish = self._choice(0, seq, "", None, seq.finish_reason, form)
                        body = self.chunk("text_completion", request_id, created, [finish])
                        if running is not None:
                            body["usage"] = running.block()
                        yield sse(body)
                        finals[prompt_index] = output
                    continue
                for seq in output.outputs:
                    index = prompt_index * n + seq.index
                    if index in ended or not (seq.delta_text or seq.delta_logprobs or seq.finished):
                        continue
                    if seq.finished:
                        ended.add(index)
                    choice = self._choice(
                        index, seq, seq.delta_text, seq.delta_logprobs, seq.finish_reason, form
                    )
                    if index not in started:
                        started.add(index)
                        choice |= self._prompt_parts(
                            request, output, seq.delta_text, seq.delta_logprobs, form
                        )
                    body = self.chunk("text_completion", request_id, created, [choice])
                    if running is not None:
                        body["usage"] = running.block()
                    if seq.finished and (kv := self.handed_over(output)) is not None:
                        body["kv_transfer_params"] = kv
                    yield trail.mark(sse(body), seq.token_ids)
                if output.finished:
                    finals[prompt_index] = output
        except Exception as exc:  # noqa: BLE001 - the stream ends with an error event
            yield sse_error(exc)
            yield SSE_DONE
            return
        if request.include_usage:
            ordered = [finals[i] for i in sorted(finals)]
            yield sse(self.chunk("text_completion", request_id, created, [], usage(ordered)))
        yield SSE_DONE

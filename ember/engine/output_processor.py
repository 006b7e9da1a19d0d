"""Output side of the frontend: token ids from the core become text and RequestOutputs.

Per sequence it detokenizes incrementally, applies stop strings (cutting the text at
the earliest match, which may span tokens, and asking the core to stop the sequence),
and works out the streaming delta, holding back text that could still begin a stop
string.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import msgspec

from ember.engine.detokenizer import IncrementalDetokenizer
from ember.engine.messages import EngineCoreOutput
from ember.engine.processor import ProcessedPrompt
from ember.kv.params import RemotePrefill
from ember.outputs import CompletionOutput, RequestOutput
from ember.sampling_params import SamplingParams


class SequenceState:
    def __init__(
        self,
        index: int,
        tokenizer,
        prompt_ids: list[int],
        params: SamplingParams,
        special_ids: frozenset[int] = frozenset(),
    ):
        self.special_ids = special_ids  # a special token that stops the sequence adds no text
        self.output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None)
        self.detokenizer = (
            IncrementalDetokenizer(tokenizer, prompt_ids, params.skip_special_tokens)
            if tokenizer is not None
            else None
        )
        self.stop = params.stop
        self.min_tokens = params.min_tokens
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.stop_token_ids = set(params.stop_token_ids)
        self.num_sent_chars = 0
        self.num_sent_tokens = 0

    def add(self, core: EngineCoreOutput) -> bool:
        """Takes a core output; True if a stop string ended the sequence here.

        An output of several tokens (speculative decoding's accepted drafts, a prefill
        worker's first tokens) is taken a token at a time where stop strings are
        watched, so that the output ends at the token that completed one, as it would
        have with a token per step."""
        ids = core.new_token_ids
        if len(ids) < 2 or not self.stop or self.detokenizer is None:
            return self._add(core)
        for i, token in enumerate(ids):
            last = i == len(ids) - 1
            one = msgspec.structs.replace(
                core,
                new_token_ids=[token],
                new_logprobs=None if core.new_logprobs is None else core.new_logprobs[i : i + 1],
                finish_reason=core.finish_reason if last else None,
            )
            if self._add(one):
                return True
        return False

    def _add(self, core: EngineCoreOutput) -> bool:
        out = self.output
        out.token_ids.extend(core.new_token_ids)
        if out.logprobs is not None and core.new_logprobs:
            out.logprobs.extend(core.new_logprobs)
        if self.detokenizer is not None:
            num_chars = len(out.text)
            ids = core.new_token_ids
            if core.finish_reason == "stop" and ids and ids[-1] in self.special_ids:
                ids = ids[:-1]  # EOS kept by skip_special_tokens=False is no part of the text
            out.text += self.detokenizer.add(ids)
            if self.stop and len(out.token_ids) > self.min_tokens and self._cut_at_stop(num_chars):
                return True
        if core.finish_reason is not None:
            out.finish_reason = core.finish_reason
            last = out.token_ids[-1] if out.token_ids else None
            if core.finish_reason == "stop" and last in self.stop_token_ids:
                out.stop_reason = last
        return False

    def _cut_at_stop(self, num_old_chars: int) -> bool:
        """Cuts the text at the earliest stop string that ends in its new characters."""
        text = self.output.text
        matches = [
            (i, s)
            for s in self.stop
            if (i := text.find(s, max(num_old_chars - len(s) + 1, 0))) >= 0
        ]
        if not matches:
            return False
        index, stop = min(matches)
        self.output.text = text[:index]
        self.output.finish_reason = "stop"
        self.output.stop_reason = stop
        return True

    def take_delta(self) -> CompletionOutput:
        """A snapshot of the output, its delta fields holding what is new since the last."""
        out = self.output
        end = len(out.text) if out.finished else max(len(out.text) - self.holdback, 0)
        end = max(end, self.num_sent_chars)
        snapshot = replace(
            out,
            token_ids=list(out.token_ids),
            logprobs=None if out.logprobs is None else list(out.logprobs),
            delta_text=out.text[self.num_sent_chars : end],
            delta_token_ids=out.token_ids[self.num_sent_tokens :],
            delta_logprobs=None if out.logprobs is None else out.logprobs[self.num_sent_tokens :],
        )
        self.num_sent_chars = end
        self.num_sent_tokens = len(out.token_ids)
        return snapshot


@dataclass
class RequestState:
    request_id: str
    prompt: ProcessedPrompt
    seqs: list[SequenceState]
    num_cached_tokens: int = 0
    queue_time: float | None = None
    kv_transfer_params: RemotePrefill | None = None
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt.prompt,
            prompt_token_ids=self.prompt.prompt_token_ids,
            outputs=[s.take_delta() for s in self.seqs],
            num_cached_tokens=self.num_cached_tokens,
            queue_time=self.queue_time,
            kv_transfer_params=self.kv_transfer_params,
            prompt_logprobs=self.prompt_logprobs,
            prompt_logprob_ranks=self.prompt_logprob_ranks,
        )


class OutputProcessor:
    """Tracks every live request; turns each step's core outputs into RequestOutputs."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", None) or {}
        self.special_ids = frozenset(i for i, token in added.items() if token.special)
        self.requests: dict[str, RequestState] = {}
        self.core_ids: dict[str, tuple[RequestState, int]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        prefilled: RemotePrefill | None = None,
        resumed: list[int] | None = None,
        resumed_finish: str | None = None,
    ) -> RequestOutput | None:
        """Starts tracking a request. A request handed over by a prefill worker already has
        its first tokens, and a resumed stream the tokens it output on another worker:
        returns the output that carries them (to send at once). Resumed tokens have no
        logprobs here: their entries are NaN (the other worker sent theirs). A resumed
        stream that they end (`resumed_finish`, or a stop string) is not tracked: its
        output is finished."""
        core_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        seqs = [
            SequenceState(i, self.tokenizer, prompt.prompt_token_ids, params, self.special_ids)
            for i in range(len(core_ids))
        ]
        state = RequestState(request_id, prompt, seqs)
        self.requests[request_id] = state
        for i, core_id in enumerate(core_ids):
            self.core_ids[core_id] = (state, i)
        if resumed:
            logprobs = None if params.logprobs is None else [{t: float("nan")} for t in resumed]
            state.seqs[0].add(EngineCoreOutput(request_id, resumed, logprobs, resumed_finish, 0))
            output = state.to_output()
            if output.finished:
                self.abort(request_id)
            return output
        if prefilled is None:
            return None
        logprobs = prefilled.first_logprobs
        state.num_cached_tokens = prefilled.num_cached_tokens
        state.seqs[0].add(
            EngineCoreOutput(
                request_id=request_id,
                new_token_ids=list(prefilled.first_token_ids),
                new_logprobs=None if logprobs is None else [dict(e) for e in logprobs],
                finish_reason=None,
                num_cached_tokens=prefilled.num_cached_tokens,
            )
        )
        return state.to_output()

    def process(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the updated requests' outputs and the core ids stopped by a stop string."""
        touched: dict[str, RequestState] = {}
        to_abort: list[str] = []
        for core in outputs:
            entry = self.core_ids.get(core.request_id)
            if entry is None:
                continue  # aborted meanwhile
            state, index = entry
            if index == 0:
                # a resumed stream's hit may reach into its resumed output: prompt tokens only
                num_prompt = len(state.prompt.prompt_token_ids)
                state.num_cached_tokens = min(max(core.num_cached_tokens, 0), num_prompt)
                if core.queue_time is not None:
                    state.queue_time = core.queue_time
                if core.prompt_logprobs is not None:  # built once, shared by every output
                    state.prompt_logprobs = [None, *core.prompt_logprobs.entries]
                    state.prompt_logprob_ranks = [None, *core.prompt_logprobs.ranks]
            if state.seqs[index].add(core):
                to_abort.append(core.request_id)
            elif core.kv_transfer_params is not None:  # handed over unless a stop string ended it
                state.kv_transfer_params = core.kv_transfer_params
            if state.seqs[index].output.finished:
                del self.core_ids[core.request_id]
            touched[state.request_id] = state
        results = []
        for state in touched.values():
            results.append(state.to_output())
            if all(s.output.finished for s in state.seqs):
                del self.requests[state.request_id]
        return results, to_abort

    def abort(self, request_id: str) -> bool:
        """Forgets a request; True if it was live (the core must abort it too)."""
        state = self.requests.pop(request_id, None)
        if state is None:
            return False
        for cid in [cid for cid, (s, _) in self.core_ids.items() if s is state]:
            del self.core_ids[cid]
        return True

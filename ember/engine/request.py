"""One request as the engine core sees it.

Life cycle: WAITING -> RUNNING -> FINISHED_*; a request whose prompt KV comes from a
prefill worker goes WAITING -> WAITING_FOR_KV -> RUNNING (or back to WAITING to
recompute, if the transfer fails); a RUNNING request whose blocks are taken
back (preemption by recompute) returns to WAITING with `num_computed_tokens = 0` and
keeps its output so far, which is recomputed as if it were prompt.

Token accounting is one model for every phase (no prefill/decode flag):

    token_ids:  [ prompt ............ | output ...... ]
                 <-- num_computed_tokens -->          computed KV in the cache
                 <----------------- num_tokens ----->  known tokens

A step computes tokens [num_computed_tokens, num_computed_tokens + n); when that reaches
num_tokens the model's last logits give a new token, appended to the output.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ember.engine.messages import PromptLogprobs
from ember.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ember.engine.grammar_masks import GrammarMatcher
    from ember.kv.params import KVTransferParams, RemotePrefill


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    cache_salt: str | None = None
    # an agent session's (x-session-affinity or kv_retention): its KV is evicted last from
    # the tiers below the pool and kept on disk for the session TTL
    retain_kv: bool = False
    # n > 1: a sibling whose prompt blocks this request waits for, to share them.
    wait_for: Request | None = None
    # grammar-constrained decoding: the sampler masks to what this allows (grammar_masks)
    grammar: GrammarMatcher | None = None
    # disaggregation: hold the prompt's blocks for a decode worker, or load them from one
    kv_transfer: KVTransferParams | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first admission; -1: not admitted yet
        self.num_loaded_end = 0  # while WAITING_FOR_KV: the prompt tokens computed once loaded
        self.prefix_hit_hint = -1  # policy "shortest": its cached prefix when first ordered
        self.status = RequestStatus.WAITING
        self.block_hashes: list[bytes] = []  # of full blocks, filled by the KV-cache manager
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        # a random request's draws: noise seeded by this and the position drawn at
        # (ember.engine.sampler.position_noise), its own seed or one drawn for it
        self.seed: int | None = None
        if not self.sampling_params.greedy:
            seed = self.sampling_params.seed
            self.seed = int(torch.randint(0, 2**62, ())) if seed is None else seed
        self.handed_over: RemotePrefill | None = None  # set when finished and held
        self.prompt_logprobs: PromptLogprobs | None = None  # collected so far, if asked for
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = PromptLogprobs()

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def ending_token_ids(self) -> set[int]:
        """The tokens that end this sequence when drawn (EOS unless ignored, stop ids)."""
        params = self.sampling_params
        eos = () if params.ignore_eos else self.eos_token_ids
        return {*eos, *params.stop_token_ids}

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for prompt logprobs and lacks some (then it computes its whole prompt)."""
        collected = self.prompt_logprobs
        return collected is not None and len(collected.entries) < self.num_prompt_tokens - 1

    @property
    def prefill_done(self) -> bool:
        return self.status.finished or self.num_computed_tokens >= self.num_prompt_tokens

    def append_token(self, token_id: int, max_model_len: int) -> RequestStatus | None:
        """Adds a sampled token; returns the finished status if it ends the request."""
        self.token_ids.append(token_id)
        if self.grammar is not None and self.grammar.accept(token_id):
            return RequestStatus.FINISHED_STOPPED
        params = self.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if token_id in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

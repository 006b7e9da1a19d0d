"""Speculative decoding: proposers of draft tokens, and how many each request gets.

Each step, before scheduling, the engine core asks its `Speculator` for draft tokens for
the running requests that decode (one known token left to compute). The scheduler gives
such a request 1 + K decode rows: its known token and its K drafts, at consecutive
positions, each row attending to the context up to itself (the KV of all rows is
written before any row attends, so the rows are causal among themselves). The sampler
verifies the rows' logits (`Sampler.verify`: greedy keeps drafts while they equal the
target's argmax; a random request's while they equal the target's own draw at that
position, whose noise depends on the request's seed and the position alone, so the
output is the target model's, token for token), and the scheduler commits the accepted
drafts plus one token of the target's own; the KV of rejected drafts is left behind
`num_computed_tokens`, to be overwritten, and never enters the prefix cache.

Proposers (behind `Proposer.propose`):
- `draft` (ember.engine.draft_model): a smaller model with the same tokenizer, with its
  own paged KV cache, run K steps per verification;
- `eagle3` and `mtp` (ember.engine.hidden_drafter): one layer over the target's hidden
  states (an EAGLE-3 head; DeepSeek-V3's multi-token-prediction layer), run K times;
- `ngram`: prompt lookup. The longest suffix of the request's tokens (between
  `min_n` and `max_n` tokens) that occurred before; the tokens that followed its most
  recent earlier occurrence are the drafts (where they run into the suffix itself, the
  repeat goes on). No model, microseconds per request.

The adaptive mode keeps, per request, how many drafts to propose: all accepted doubles
it (up to `num_speculative_tokens`), none accepted halves it; at 0 the request decodes
without drafts for a while (8 steps, doubling up to 64 each time it falls back to 0),
then tries one draft again. In an engine, the adaptive mode also weighs each step's
drafts against what they cost at that batch size (ember.engine.spec_planner): from each
request's acceptance estimate (accepted drafts against rejections, recent ones counting
most, pulled toward all requests' rate) and the measured step and proposer times, it
keeps the drafts that raise expected output tokens per second, which can be none.
"""

from __future__ import annotations

import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ember.config import EngineConfig
from ember.engine.request import Request

if TYPE_CHECKING:
    import torch

    from ember.engine.kv_cache import KVCacheManager
    from ember.engine.model_runner import ModelRunner
    from ember.engine.spec_planner import DraftPlanner
    from ember.engine.step_cost import StepCostModel, StepShape

COOLDOWN_STEPS = (8, 64)  # steps without drafts after acceptance fell to 0: first, at most
ACCEPTANCE_FADE = 0.8  # a request's acceptance counts fade by this at each verification
GLOBAL_FADE = 0.995  # all requests' counts
PRIOR_WEIGHT = 2.0  # all requests' rate counts as this many verifications of a new one
REPLY_TOKENS = 128.0  # a reply's expected length before any has finished
REPLY_FADE = 0.8  # each finished reply moves the expected length by 1 - this


class Proposer(ABC):
    """Proposes up to `num_tokens[i]` draft tokens to follow `requests[i]`'s tokens."""

    # what a proposer that runs a model has computed since start: its forward passes,
    # and the rows of all of them (what the adaptive mode's cost of proposing is fit to)
    num_passes: int = 0
    num_rows: int = 0

    @abstractmethod
    def propose(
        self, requests: Sequence[Request], num_tokens: Sequence[int]
    ) -> list[list[int]]: ...

    def forget(self, request: Request) -> None:  # noqa: B027 - most proposers keep nothing
        """The request ended (finished or aborted): what the proposer keeps for it goes."""

    def lag(self, request: Request) -> int:
        """The tokens of `request` the proposer would compute before drafting for it now
        (a draft model's catch-up over what the target decoded since it last drafted)."""
        return 0

    def take_features(self, request: Request, start: int, rows: torch.Tensor) -> None:  # noqa: B027
        """The target's `ModelRunner.features` rows of `request` from position `start`
        (drafters that read the target's hidden states: ember.engine.hidden_drafter)."""

    def close(self) -> None:  # noqa: B027
        """Frees what the proposer holds (a draft model's KV cache)."""


class NgramProposer(Proposer):
    """Prompt lookup over the request's prompt and output (module docstring)."""

    def __init__(self, min_n: int = 2, max_n: int = 5) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min <= max; got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n
        self._tokens: weakref.WeakKeyDictionary[Request, _Tokens] = weakref.WeakKeyDictionary()

    def propose(self, requests, num_tokens):
        out = []
        for request, k in zip(requests, num_tokens, strict=True):
            if k <= 0:
                out.append([])
                continue
            tokens = self._tokens.get(request)
            if tokens is None:
                tokens = self._tokens[request] = _Tokens()
            out.append(self.lookup(tokens.sync(request.token_ids), k))
        return out

    def lookup(self, tokens: np.ndarray, k: int) -> list[int]:
        """The `k` tokens after the most recent earlier occurrence of the longest suffix
        of `tokens` of `min_n` to `max_n` tokens, repeating them where they reach the end
        (none if no suffix matches)."""
        n = len(tokens)
        if n <= self.min_n:
            return []
        # ends[i]: an earlier position whose token equals the last token, and whose
        # `depth` tokens before it equal the suffix's as well
        ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
        best, depth = None, 1
        while ends.size:
            if depth >= self.min_n:
                best = ends
            if depth == self.max_n:
                break
            ends = ends[ends >= depth]
            ends = ends[tokens[ends - depth] == tokens[n - 1 - depth]]
            depth += 1
        if best is None:
            return []
        start = int(best[-1]) + 1  # the most recent occurrence
        draft = tokens[start : start + k].tolist()
        # a match that runs into the end is a repeat of period n - start: the drafts go
        # on repeating it (a loop, a list) rather than stop short
        while len(draft) < k:
            draft.append(draft[start + len(draft) - n])
        return draft


class _Tokens:
    """A request's token ids as a growing int64 array (appended to, never rebuilt)."""

    def __init__(self) -> None:
        self.array = np.empty(256, dtype=np.int64)
        self.size = 0

    def sync(self, token_ids: list[int]) -> np.ndarray:
        n = len(token_ids)
        if n > len(self.array):
            grown = np.empty(max(n, 2 * len(self.array)), dtype=np.int64)
            grown[: self.size] = self.array[: self.size]
            self.array = grown
        if n > self.size:
            self.array[self.size : n] = token_ids[self.size : n]
        self.size = n
        return self.array[:n]


@dataclass
class SpecStats:
    """Counters since start (for /load, /metrics and `ember bench`)."""

    num_drafts: int = 0  # verifications of one request's drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: drafts at i kept

    def as_dict(self) -> dict[str, Any]:
        """The counters, the share of drafts accepted, and the mean tokens per verification
        (accepted drafts + the target's own)."""
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_rate": self.num_accepted_tokens / max(self.num_draft_tokens, 1),
            "mean_accepted_length": 1 + self.num_accepted_tokens / max(self.num_drafts, 1),
        }

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafts:
            self.accepted_per_position += [0] * (num_drafts - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1


@dataclass
class _Budget:
    """One request's adaptive number of drafts."""

    k: int
    cooldown: int = 0  # steps left without drafts
    next_cooldown: int = COOLDOWN_STEPS[0]
    # drafts accepted, and verifications that rejected one, fading (ACCEPTANCE_FADE)
    accepted: float = 0.0
    rejected: float = 0.0


class Speculator:
    """Decides which requests get drafts and how many, asks the proposer, and learns
    from what the sampler accepted."""

    def __init__(
        self,
        proposer: Proposer,
        num_tokens: int,
        adaptive: bool = True,
        disable_by_batch_size: int | None = None,
        planner: DraftPlanner | None = None,
    ) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.adaptive = adaptive
        self.disable_by_batch_size = disable_by_batch_size
        self.planner = planner if adaptive else None
        self.stats = SpecStats()
        self._budgets: weakref.WeakKeyDictionary[Request, _Budget] = weakref.WeakKeyDictionary()
        self._accepted = self._rejected = 0.0  # all requests', fading (GLOBAL_FADE)
        self._reply_tokens = REPLY_TOKENS  # finished replies' length, fading (REPLY_FADE)

    def propose(self, requests: Sequence[Request], max_model_len: int) -> dict[str, list[int]]:
        """Drafts for those of `requests` (running, decoding) that take them now: none
        where they are `disable_by_batch_size` or more."""
        limit = self.disable_by_batch_size
        if limit is not None and len(requests) >= limit:
            return {}
        chosen, ks, lefts = [], [], []
        for request in requests:
            k, left = self._k(request, max_model_len)
            if k > 0:
                chosen.append(request)
                ks.append(k)
                lefts.append(min(left, self._reply_tokens))  # as long as recent replies
        if self.planner is not None and chosen:
            acceptance = [self.acceptance(request) for request in chosen]
            lags = [self.proposer.lag(request) for request in chosen]
            planned = self.planner.plan(len(requests), ks, acceptance, lags, lefts)
            chosen = [r for r, k in zip(chosen, planned, strict=True) if k > 0]
            ks = [k for k in planned if k > 0]
        drafts = self._run_proposer(chosen, ks) if chosen else []
        out = {}
        for request, draft, k in zip(chosen, drafts, ks, strict=True):
            draft = draft[:k]
            if draft and request.grammar is not None:  # what the grammar would refuse goes
                draft = draft[: request.grammar.valid_prefix(draft)]
            if draft:
                out[request.request_id] = draft
        return out

    def _run_proposer(self, requests: list[Request], ks: list[int]) -> list[list[int]]:
        proposer = self.proposer
        passes, rows, start = proposer.num_passes, proposer.num_rows, time.perf_counter()
        drafts = proposer.propose(requests, ks)
        if self.planner is not None:
            ms = (time.perf_counter() - start) * 1e3
            self.planner.observe_proposal(
                proposer.num_passes - passes, proposer.num_rows - rows, ms
            )
        return drafts

    def acceptance(self, request: Request) -> float:
        """The estimated chance that each of the request's drafts is accepted (given those
        before it were): its own recent verifications, pulled toward all requests'."""
        overall = (self._accepted + 1) / (self._accepted + self._rejected + 2)
        budget = self._budget(request)
        seen = budget.accepted + budget.rejected
        return (budget.accepted + PRIOR_WEIGHT * overall) / (seen + PRIOR_WEIGHT)

    def _k(self, request: Request, max_model_len: int) -> tuple[int, int]:
        """The drafts the request's budget allows now, and the tokens it may decode."""
        left = min(
            request.max_tokens - request.num_output_tokens, max_model_len - request.num_tokens
        )
        # the last token of a step is the target's own, within the context
        if left <= 1:
            return 0, left
        budget = self._budget(request)
        if budget.cooldown:
            budget.cooldown -= 1
            return 0, left
        return min(budget.k, left - 1), left

    def _budget(self, request: Request) -> _Budget:
        budget = self._budgets.get(request)
        if budget is None:
            budget = self._budgets[request] = _Budget(self.num_tokens)
        return budget

    def forget(self, request: Request, finished: bool = True) -> None:
        """The request ended: the proposer forgets it; a reply that finished (not
        aborted) updates how long replies run."""
        self.proposer.forget(request)
        if finished:
            self._reply_tokens += (1 - REPLY_FADE) * (
                request.num_output_tokens - self._reply_tokens
            )

    def observe_step(self, shape: StepShape, num_seqs: int, ms: float) -> None:
        """The time of a step of `num_seqs` sequences (what drafts cost, for the plan)."""
        if self.planner is not None:
            self.planner.observe_step(shape, num_seqs, ms)

    def observe(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """What the verification of `num_drafts` drafts of `request` kept."""
        self.stats.record(num_drafts, num_accepted)
        if not self.adaptive:
            return
        budget = self._budget(request)
        rejected = int(num_accepted < num_drafts)
        budget.accepted = ACCEPTANCE_FADE * budget.accepted + num_accepted
        budget.rejected = ACCEPTANCE_FADE * budget.rejected + rejected
        self._accepted = GLOBAL_FADE * self._accepted + num_accepted
        self._rejected = GLOBAL_FADE * self._rejected + rejected
        if num_accepted == num_drafts:
            budget.k = min(max(2 * budget.k, 1), self.num_tokens)
        elif num_accepted == 0:
            budget.k //= 2
            if budget.k == 0:  # off for a while, then one draft again
                budget.cooldown = budget.next_cooldown
                budget.next_cooldown = min(2 * budget.next_cooldown, COOLDOWN_STEPS[1])
                budget.k = 1
        else:
            budget.k = max(num_accepted + 1, 1)
            budget.next_cooldown = COOLDOWN_STEPS[0]
        if num_accepted:
            budget.next_cooldown = COOLDOWN_STEPS[0]


def make_speculator(
    config: EngineConfig,
    runner: ModelRunner,
    kv: KVCacheManager,
    max_model_len: int,
    step_cost: StepCostModel | None = None,
) -> Speculator | None:
    """The engine's speculator over the target `runner` and its block manager `kv`, or
    None when speculative decoding is off (the method names were checked by
    EngineConfig); a draft model gets as many KV blocks as the target. The adaptive mode
    plans each step's drafts by cost (`DraftPlanner`) given the engine's `step_cost`."""
    method = config.speculative_method
    if method is None:
        return None
    if method == "draft":
        from ember.engine.draft_model import DraftModelProposer

        proposer = DraftModelProposer(config, runner.model_config, max_model_len, kv.num_blocks)
    elif method == "eagle3":
        from ember.engine.hidden_drafter import eagle3_proposer

        proposer = eagle3_proposer(config, runner, kv, max_model_len)
    elif method == "mtp":
        from ember.engine.hidden_drafter import mtp_proposer

        proposer = mtp_proposer(runner, kv)
    else:
        proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    planner = None
    if config.speculative_adaptive and step_cost is not None:
        from ember.engine.spec_planner import DraftPlanner

        planner = DraftPlanner(step_cost)
    return Speculator(
        proposer,
        config.num_speculative_tokens,
        config.speculative_adaptive,
        config.speculative_disable_by_batch_size,
        planner,
    )

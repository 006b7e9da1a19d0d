"""Continuous batching under a per-step token budget.

Each step the scheduler decides how many tokens of each request to compute. Under
policy "fcfs": running requests first (decodes and unfinished prefill chunks, in
admission order), then waiting requests in arrival order while the budget,
`max_num_seqs` and the KV cache allow. A prefix-cache hit simply admits a request with tokens already computed.

Policy "shortest" orders the prompts still to compute, running ones' chunks and waiting
ones alike, by their response ratio (highest first): (time waited + prefill time left) /
prefill time left, the prefill time from the step cost model. A short prompt goes before
a long one that arrived a moment earlier, so one long prompt no longer holds up the
first tokens of every short one behind it; and since a prompt's ratio grows with its
wait, none waits for ever. Decodes are scheduled first under either policy.

Decodes (requests computing one token) are always scheduled; while any run, the tokens
of prefill chunks are capped so that the step's predicted time (`StepCostModel`) stays
within `max_step_ms` (or twice the decodes' own time, where they alone come near it), but
never below `min_prefill_tokens`, so prompts keep moving. With no decodes running, or
`max_step_ms` 0, prefill takes the whole `max_num_batched_tokens`; and with no decodes
running, a prompt that would finish its prefill within `max_prefill_step_tokens` takes
what it needs past that, while the step is predicted to stay within `max_step_ms` (so a
burst of prompts sharing a prefix, whose later ones find the first one's blocks,
computed in the same step, is one step, not two).
When a running request cannot get a block, the most recently admitted running request
is preempted (its blocks freed, to be recomputed later); the oldest request always
makes progress, so there is neither deadlock nor starvation.

With a KV connector, a waiting request whose prompt KV is on a prefill worker is
admitted into WAITING_FOR_KV (blocks allocated, no budget spent) while its blocks
arrive, and joins the running requests once they have; a finished prefill that a decode
worker will fetch keeps its blocks until the connector lets them go.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ember.config import SCHEDULING_POLICIES
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus
from ember.engine.step_cost import StepCostModel, StepShape

if TYPE_CHECKING:
    from collections.abc import Callable

    from ember.kv.connector import KVConnector


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int
    block_ids: list[int]
    # a decode's draft tokens (speculative decoding), computed after its known token
    spec_token_ids: list[int] = field(default_factory=list)
    # the position of this step's first token: the request's computed tokens when it was
    # scheduled, and the tokens of its steps still in flight (pipeline parallel: a
    # prompt's next chunk goes while its last is in a later stage)
    start: int = -1
    # the rank whose KV pool holds its blocks (data-parallel attention: the rank that runs it)
    rank: int = 0
    # whether this step reaches the end of the known tokens, so that it yields a token
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        if self.start < 0:
            self.start = self.request.num_computed_tokens
        self.samples = self.start + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    prefill_cap: int | None = None  # the step budget's cap on prefill tokens, if it set one
    # a running request found no free block while other steps were in flight (pipeline)
    blocked: bool = False

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens + len(s.spec_token_ids) for s in self.scheduled)

    def shape(self) -> StepShape:
        """The step's work for the cost model (read before `Scheduler.update`)."""
        chunks = [s for s in self.scheduled if s.num_new_tokens > 1]
        return StepShape(
            num_prefill_tokens=sum(s.num_new_tokens for s in chunks),
            num_decode_rows=sum(1 + len(s.spec_token_ids) for s in self.scheduled) - len(chunks),
            num_attention_pairs=sum(
                StepShape.chunk_pairs(s.request.num_computed_tokens, s.num_new_tokens)
                for s in chunks
            ),
        )

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass
class _Budget:
    """What is left of one step's tokens; `num_prefill_tokens` of them for requests that
    compute more than one token (the rest are kept for the step's decodes), and past
    both, `num_extra` for prompts that finish their prefill with them, while the step
    (its prompts' tokens and attention pairs so far in `shape`) is predicted to take at
    most `max_ms` (`predict_ms`; None: no bound)."""

    num_tokens: int
    num_prefill_tokens: int
    num_extra: int = 0
    predict_ms: Callable[[StepShape], float] | None = None
    max_ms: float = 0.0
    shape: StepShape = field(default_factory=StepShape)
    extra_taken: int = 0  # by the last `take`
    _pairs_taken: float = 0.0

    def take(self, num_left: int, start: int = 0, extra: bool = True) -> int:
        """Tokens for a request with `num_left` to compute from position `start`; 0: none
        this step. `extra`: all of them if the extra makes room for all."""
        room = min(self.num_tokens, self.num_prefill_tokens)
        self.extra_taken = 0
        if extra and num_left > 1 and room < num_left <= room + self.num_extra:
            if self._in_time(num_left, start):
                self.extra_taken = num_left - room
                self._move_extra(self.extra_taken)
        num_new = min(num_left, self.num_tokens)
        self._pairs_taken = 0.0
        if num_new > 1:
            num_new = min(num_new, self.num_prefill_tokens)
            self.num_prefill_tokens -= num_new
            self._pairs_taken = StepShape.chunk_pairs(start, num_new)
            self._add_shape(num_new, self._pairs_taken)
        self.num_tokens -= num_new
        return num_new

    def _in_time(self, num_new: int, start: int) -> bool:
        if self.predict_ms is None:
            return True
        pairs = self.shape.num_attention_pairs + StepShape.chunk_pairs(start, num_new)
        after = StepShape(self.shape.num_prefill_tokens + num_new, 0, pairs)
        return self.predict_ms(after) <= self.max_ms

    def _add_shape(self, num_new: int, pairs: float) -> None:
        self.shape = StepShape(
            self.shape.num_prefill_tokens + num_new, 0, self.shape.num_attention_pairs + pairs
        )

    @property
    def left(self) -> bool:
        return self.num_tokens > 0 or self.num_extra > 0

    def give_back(self, num_new: int) -> None:
        """Returns what the last `take` gave, for a request that could not use it."""
        self.num_tokens += num_new
        if num_new > 1:
            self.num_prefill_tokens += num_new
            self._add_shape(-num_new, -self._pairs_taken)
        self._move_extra(-self.extra_taken)
        self.extra_taken = self._pairs_taken = 0

    def _move_extra(self, num: int) -> None:
        self.num_extra -= num
        self.num_tokens += num
        self.num_prefill_tokens += num


@dataclass
class TokenUpdate:
    request: Request
    new_token_ids: list[int]


class Scheduler:
    """Owns the waiting and running queues and the KV-cache manager.

    Called by the engine core: `add`/`abort` at any time, then once per step
    `schedule()`, the model runs the result, and `update(output, sampled)` appends the
    sampled tokens, finishes requests and frees their blocks.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        connector: KVConnector | None = None,
        cost_model: StepCostModel | None = None,
        max_step_ms: float = 0.0,
        min_prefill_tokens: int = 1,
        policy: str = "fcfs",
        max_prefill_step_tokens: int = 0,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}"
            )
        self.policy = policy
        self.kv_cache = kv_cache
        self.connector = connector
        self.cost_model = cost_model
        self.max_step_ms = max_step_ms if cost_model is not None else 0.0  # 0: no step budget
        self.min_prefill_tokens = min_prefill_tokens
        self.max_num_batched_tokens = max_num_batched_tokens
        # a step with no decodes may go up to this to finish prompts (0: no further)
        self.max_prefill_step_tokens = max_prefill_step_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # since start, for metrics and tests
        self.num_prompt_tokens_computed = 0  # by the model, since start (not cached or loaded)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if self.connector is not None and self.kv_cache.enable_prefix_caching:
            _, num_hit = self.kv_cache.get_computed_blocks(request)
            self.connector.request_added(request, num_hit)  # lookups and fetches start now

    def abort(self, request_id: str) -> Request | None:
        """Ends a request at any moment and frees its blocks; None if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status == RequestStatus.WAITING_FOR_KV:
            # a thread is writing its blocks: they are freed when its load ends
            request.status = RequestStatus.FINISHED_ABORTED
            del self.requests[request.request_id]
            return request
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def schedule(
        self,
        drafts: dict[str, list[int]] | None = None,
        busy: dict[str, int] | None = None,
        max_scheduled: int | None = None,
        decodes_only: bool = False,
    ) -> SchedulerOutput:
        """This step's work; `drafts`: draft tokens (by request id) for running requests
        that decode, each computed after the request's known token if the step has room.

        Pipeline parallel (several steps in flight): `busy` are the running requests in
        steps not yet updated (id -> their tokens in those steps), which this one never
        preempts (a request that needs blocks then waits for those steps instead) and
        leaves out, but for the next chunk of a prompt whose last chunk is in flight:
        the stages run steps in order, so that chunk reads the KV the one before wrote.
        `max_scheduled`: the most requests this step takes, so that the running ones
        spread over the steps in flight. `decodes_only`: a step of the running requests'
        decodes alone (between the slices of a prompt's prefill in flight), no prompt
        admitted or continued."""
        busy = busy or {}
        if self.connector is not None:
            self._end_loads()
            for key in self.connector.collect():
                self.kv_cache.release_held(key)
        out = SchedulerOutput()
        limit = max_scheduled if max_scheduled is not None else len(self.requests) + 1
        if decodes_only:
            self._schedule_running(
                out, _Budget(self.max_num_batched_tokens, 0), drafts or {}, busy, limit
            )
            return out
        budget = self._budget(out)
        later = self._order_prompts(busy) if self.policy == "shortest" else set()
        self._schedule_running(out, budget, drafts or {}, busy, limit, later)
        if not out.preempted and not (busy and out.blocked):
            self._schedule_waiting(out, budget, limit)
            if later:  # the running prompts that waiting ones went before, if room is left
                self._schedule_running(out, budget, {}, busy, limit, later, second=True)
                if not out.scheduled and not out.blocked:
                    # none of the waiting ones got in, nor those prompts in the blocks left:
                    # they go on as under fcfs, preempting for blocks (else every step is
                    # empty, for ever, once the prompts hold all the blocks)
                    self._schedule_running(out, budget, drafts or {}, busy, limit)
        return out

    def _order_prompts(self, busy: dict[str, int]) -> set[str]:
        """Policy "shortest": sorts the waiting requests by response ratio and returns the
        running prompts (ids) that the first of them goes before."""
        if not self.waiting:
            return set()
        now = time.monotonic()
        # prefill time per token at a full chunk, as this machine's steps measured it
        full = self.max_num_batched_tokens
        ms_per_token = 1.0
        if self.cost_model is not None:
            ms_per_token = max(self.cost_model.predict_ms(StepShape(full)) / full, 1e-6)

        def ratio(request: Request, num_left: int) -> float:
            left_ms = max(num_left, 1) * ms_per_token
            return ((now - request.arrival_time) * 1000.0 + left_ms) / left_ms

        def waiting_ratio(request: Request) -> float:
            if request.prefix_hit_hint < 0:  # once: the cache may change, this is a hint
                hit = 0
                if not request.needs_prompt_logprobs:
                    _, hit = self.kv_cache.get_computed_blocks(request)
                request.prefix_hit_hint = hit
            computed = max(request.num_computed_tokens, request.prefix_hit_hint)
            return ratio(request, request.num_tokens - computed)

        self.waiting = deque(sorted(self.waiting, key=waiting_ratio, reverse=True))
        # one waiting for a sibling's prefill (n > 1) cannot go before anything yet
        ready = [r for r in self.waiting if r.wait_for is None or r.wait_for.prefill_done]
        if not ready:
            return set()
        first = waiting_ratio(ready[0])
        later = set()
        for request in self.running:
            left = (
                request.num_tokens - request.num_computed_tokens - busy.get(request.request_id, 0)
            )
            if left > 1 and ratio(request, left) < first:
                later.add(request.request_id)
        return later

    def _budget(self, out: SchedulerOutput) -> _Budget:
        """This step's tokens: one for every decode, the rest for prefill chunks, which the
        step budget caps while decodes run (never below `min_prefill_tokens`). With no
        decodes, prompts that can finish their prefill within `max_prefill_step_tokens`
        do."""
        chunked = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        num_decodes = len(self.running) - len(chunked)
        num_prefill = max(self.max_num_batched_tokens - num_decodes, 0)
        if num_decodes and self.max_step_ms > 0 and (chunked or self.waiting):
            start = chunked[0].num_computed_tokens if chunked else 0
            # a box too slow for the budget: prefill still gets as long as the decodes
            decode_ms = self.cost_model.predict_ms(StepShape(num_decode_rows=num_decodes))
            max_ms = max(self.max_step_ms, 2 * decode_ms)
            cap = self.cost_model.max_prefill_tokens(num_decodes, start, max_ms, num_prefill)
            if cap < num_prefill:
                out.prefill_cap = num_prefill = max(cap, min(self.min_prefill_tokens, num_prefill))
        extra = 0 if num_decodes else self.max_prefill_step_tokens - self.max_num_batched_tokens
        if extra <= 0:
            return _Budget(self.max_num_batched_tokens, num_prefill)
        # a step past the chunk keeps within the step budget too: arrivals wait for it
        predict = self.cost_model.predict_ms if self.max_step_ms > 0 else None
        return _Budget(self.max_num_batched_tokens, num_prefill, extra, predict, self.max_step_ms)

    def _schedule_running(
        self,
        out: SchedulerOutput,
        budget: _Budget,
        drafts: dict[str, list[int]],
        busy: dict[str, int],
        limit: int,
        later: set[str] = frozenset(),
        second: bool = False,
    ) -> None:
        """The running requests' work; those in `later` (prompts that waiting ones go
        before) only in the `second` pass, which takes blocks where free and preempts none."""
        i = 0
        while i < len(self.running) and budget.left and len(out.scheduled) < limit:
            request = self.running[i]
            if (request.request_id in later) != second:
                i += 1
                continue
            in_flight = busy.get(request.request_id, 0)
            left = request.num_tokens - request.num_computed_tokens - in_flight
            if left < 1:  # its step in flight samples: its next token is not known yet
                i += 1
                continue
            start = request.num_computed_tokens + in_flight
            num_new = budget.take(left, start)
            if num_new == 0:  # a prefill chunk, when the step has no room for more
                i += 1
                continue
            spec = drafts.get(request.request_id, []) if num_new == 1 and not in_flight else []
            spec = spec[: budget.num_tokens]
            # drafts get slots only where there are free blocks for them
            if spec and self.kv_cache.allocate_slots(request, 1, num_lookahead=len(spec)) is None:
                spec = []
            taken = in_flight + num_new
            if budget.extra_taken and self.kv_cache.allocate_slots(request, taken) is None:
                # all it has left does not fit the free blocks: a chunk within the budget,
                # as without the extra (nothing preempted for a longer step)
                budget.give_back(num_new)
                num_new = budget.take(left, start, extra=False)
                if num_new == 0:
                    i += 1
                    continue
            if not spec:
                while self.kv_cache.allocate_slots(request, in_flight + num_new) is None:
                    if second:  # after the waiting ones, with the blocks they left
                        budget.give_back(num_new)
                        return
                    if busy:  # the steps in flight may free blocks: wait, preempt nothing
                        out.blocked = True
                        return
                    victim = self._victim(request)
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is request:
                        return
            budget.num_tokens -= len(spec)
            block_ids = self.kv_cache.block_ids(request.request_id)
            rank = self.kv_cache.rank(request)
            sched = ScheduledRequest(request, num_new, block_ids, list(spec), start, rank)
            out.scheduled.append(sched)
            i += 1

    def _victim(self, request: Request) -> Request:
        """The request to preempt for `request`'s blocks: the last running one whose blocks
        are in the same pool (there is one rank's pool without data-parallel attention;
        `request` itself when no other is)."""
        rank = self.kv_cache.rank(request)
        for i in range(len(self.running) - 1, -1, -1):
            if self.kv_cache.rank(self.running[i]) == rank:
                return self.running.pop(i)
        raise AssertionError("a running request is not in the running list")

    def _schedule_waiting(self, out: SchedulerOutput, budget: _Budget, limit: int) -> None:
        deferred: list[Request] = []
        while (
            self.waiting
            and budget.left
            and self._num_admitted < self.max_num_seqs
            and len(out.scheduled) < limit
        ):
            request = self.waiting.popleft()
            if request.wait_for is not None and not request.wait_for.prefill_done:
                deferred.append(request)  # n > 1: share the sibling's prompt blocks
                continue
            if request.needs_prompt_logprobs:  # the logits of every prompt token
                hits, num_hit = [], 0
            else:
                hits, num_hit = self.kv_cache.get_computed_blocks(request)
            num_external = self.connector.external_tokens(request, num_hit) if self.connector else 0
            if num_external is None:  # the cluster store has not answered yet
                deferred.append(request)
                continue
            if num_external:
                if not self._start_load(request, hits, num_hit, num_external):
                    break
                continue
            if self.connector is not None:
                self.connector.release_unused(request)  # nothing (more) to load
            num_left = request.num_tokens - num_hit
            num_new = budget.take(num_left, num_hit)
            allocated = self._allocate(request, num_new, hits)
            if not allocated and budget.extra_taken:  # all of it does not fit: a chunk
                budget.give_back(num_new)
                num_new = budget.take(num_left, num_hit, extra=False)
                allocated = self._allocate(request, num_new, hits)
            if not allocated:
                self.waiting.appendleft(request)
                break
            self._admit(request, num_hit)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            block_ids = self.kv_cache.block_ids(request.request_id)
            rank = self.kv_cache.rank(request)
            out.scheduled.append(ScheduledRequest(request, num_new, block_ids, rank=rank))
        self.waiting.extendleft(reversed(deferred))

    def _allocate(self, request: Request, num_new: int, hits) -> bool:
        """Blocks for a waiting request's first `num_new` tokens past its hits, if free."""
        return num_new > 0 and self.kv_cache.allocate_slots(request, num_new, hits) is not None

    @property
    def _num_admitted(self) -> int:
        loading = self.connector.num_loading if self.connector is not None else 0
        return len(self.running) + loading

    def _admit(self, request: Request, num_hit: int) -> None:
        request.num_computed_tokens = num_hit
        if request.num_cached_tokens < 0:
            cached = self.connector.cached_tokens(request, num_hit) if self.connector else num_hit
            request.num_cached_tokens = cached
            request.first_scheduled_time = time.monotonic()
            self.kv_cache.record_admission(request, num_hit)

    def _start_load(self, request: Request, hits, num_hit: int, num_external: int) -> bool:
        """Admits a request whose prompt KV comes from outside; False if no blocks yet."""
        if self.kv_cache.allocate_slots(request, num_external, hits, cache=False) is None:
            self.waiting.appendleft(request)
            return False
        request.num_loaded_end = num_hit + num_external
        self._admit(request, num_hit)
        request.status = RequestStatus.WAITING_FOR_KV
        self.connector.start_load(request, self.kv_cache.block_ids(request.request_id), num_hit)
        return True

    def _end_loads(self) -> None:
        for request, ok in self.connector.finished_loads():
            if request.status == RequestStatus.FINISHED_ABORTED:
                self.kv_cache.free(request)
            elif ok:
                request.num_computed_tokens = request.num_loaded_end
                self.kv_cache.cache_blocks(request, request.num_loaded_end)
                request.kv_transfer = None  # released there: a preemption recomputes here
                request.status = RequestStatus.RUNNING
                self.running.append(request)
            else:  # recompute the prompt here, like any request
                self.kv_cache.free(request)
                request.num_computed_tokens = request.num_loaded_end = 0
                request.kv_transfer = None
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)

    def update(
        self, out: SchedulerOutput, sampled: dict[str, list[int]]
    ) -> tuple[list[TokenUpdate], list[Request]]:
        """Advances computed counts and appends sampled tokens: one per sampling request,
        or with drafts, the accepted drafts and the target's next token (those up to
        one that ends the request).

        Returns the requests that got tokens this step (finished or not), and those
        that finished.
        """
        updated: list[TokenUpdate] = []
        finished: list[Request] = []
        block_size = self.kv_cache.block_size
        for sched in out.scheduled:
            request = sched.request
            prompt_left = request.num_prompt_tokens - request.num_computed_tokens
            self.num_prompt_tokens_computed += max(min(sched.num_new_tokens, prompt_left), 0)
            start = request.num_computed_tokens // block_size
            tokens, status = [], None
            for token in sampled.get(request.request_id, ()):
                tokens.append(token)
                status = request.append_token(token, self.max_model_len)
                if status is not None:
                    break
            # every appended token but the last was a draft whose KV this step computed
            num_accepted = max(len(tokens) - 1, 0)
            request.num_computed_tokens += sched.num_new_tokens + num_accepted
            end = request.num_computed_tokens // block_size
            if num_accepted:  # blocks the accepted drafts filled are findable now
                self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            if end > start and self.connector is not None:
                self.connector.blocks_computed(request, sched.block_ids, start, end)
            if not tokens:
                continue
            updated.append(TokenUpdate(request, tokens))
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
                finished.append(request)
        return updated, finished

    def _preempt(self, request: Request) -> None:
        self._save(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _save(self, request: Request) -> None:
        """Its computed full blocks into the tiers below the pool, if there are any."""
        if self.connector is not None:
            self.connector.save(request, self.kv_cache.block_ids(request.request_id))

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        handed_over = None
        if self.connector is not None:  # held for a decode worker, or saved into the tiers
            block_ids = self.kv_cache.block_ids(request.request_id)
            at_length = status == RequestStatus.FINISHED_LENGTH
            handed_over = self.connector.request_finished(request, block_ids, at_length)
        if handed_over is not None:  # a decode worker will fetch them
            request.handed_over = handed_over
            self.kv_cache.hold(request, handed_over.transfer_id)
        else:
            self.kv_cache.free(request)
        del self.requests[request.request_id]

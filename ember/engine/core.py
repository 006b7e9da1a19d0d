"""The engine core: scheduler + KV-cache manager + model runner, driven by `step()`.

Knows token ids only (no text, no HTTP). Life cycle: built once (loads the model,
sizes and allocates the KV cache), then `add_request` / `abort_requests` at any time
and `step()` in a loop while `has_unfinished()`; each step returns the new tokens of
every sequence that got one, and marks those that finished. A user request with n > 1
runs as n sequences `{id}#{i}` (ember.engine.intake). Prompt steps beside decodes may run
a slice of layers at a time (ember.engine.prompt_slicer decides; `_sliced_step`).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from ember import envs, startup
from ember.config import EngineConfig
from ember.engine.idle import IdleWork
from ember.engine.intake import RequestIntake
from ember.engine.kv_cache import KVCacheManager
from ember.engine.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from ember.engine.model_runner import ModelRunner, PendingStep, SlicedStep
from ember.engine.prompt_slicer import PromptSlicer
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.engine.speculative import make_speculator
from ember.engine.step_cost import StepCostModel, StepShape
from ember.kv.connector import ConnectorContext, KVStats, MultiConnector, make_connector
from ember.kv.tiers import TieredStore
from ember.loader.checkpoint import Checkpoint, open_checkpoint
from ember.model_config import ModelConfig

logger = logging.getLogger("ember.engine")


class EngineCore:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, checkpoint: Checkpoint
    ) -> None:
        self.config = config
        self.checkpoint = checkpoint
        self.model_config = model_config
        self.max_model_len = resolve_max_model_len(config, model_config)
        start = time.perf_counter()
        self.runner = ModelRunner(config, model_config, checkpoint, self.max_model_len)
        try:
            num_blocks = self._allocate_kv_cache()
            # data-parallel attention: a pool per rank, each rank's sequences in its own
            ranks = config.tensor_parallel_size if config.data_parallel_attention else 1
            self.kv_cache = KVCacheManager(
                num_blocks, config.block_size, config.enable_prefix_caching, ranks
            )
            self.connector = self._make_connector(config)
        except BaseException:
            self.runner.close()  # no shared-memory file or other rank left behind
            raise
        self.step_cost = StepCostModel()
        # pipeline parallel: one step in flight per stage (see _pipelined_step)
        self.steps_in_flight = envs.pipeline_steps_in_flight(config.pipeline_parallel_size)
        self._in_flight: deque[InFlight] = deque()
        self._aborts_due: set[str] = set()
        alone = self.steps_in_flight == 1  # one step at a time: no pipeline
        self.scheduler = Scheduler(
            self.kv_cache,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.max_model_len,
            self.connector,
            cost_model=self.step_cost,
            # a pipelined step's time is not its own: no step budget
            max_step_ms=config.max_step_ms if alone else 0.0,
            min_prefill_tokens=config.min_prefill_tokens,
            policy=config.scheduling_policy,
            # pipelined, a prompt's chunks overlap in the stages: no longer steps
            max_prefill_step_tokens=config.max_prefill_step_tokens if alone else 0,
        )
        self.step_stats = StepStats()
        self.speculator = make_speculator(
            config, self.runner, self.kv_cache, self.max_model_len, self.step_cost
        )
        # a prompt step's layers in slices, decode steps between them (_sliced_step): one
        # process on CPU (a GPU's slices would be timed as they are queued, not run), one
        # step at a time, no drafts (EAGLE-3 reads the prompt's hidden states, which a
        # decode step between would replace)
        one = alone and config.world_size == 1 and self.speculator is None
        one = one and self.runner.device.type == "cpu"
        target_itl_ms = config.target_itl_ms if one else 0.0  # None: auto
        self.slicer = PromptSlicer(target_itl_ms, self.step_cost, self.runner, self.kv_cache)
        self.idle = IdleWork(
            config, self.runner, self.kv_cache, self.step_cost, self.max_model_len,
            model_config.vocab_size,
            # the step cost model's calibration: one CPU process, one step at a time
            calibrate=config.world_size == 1 and alone
            and self.speculator is None and self.runner.device.type == "cpu",
        )  # fmt: skip
        self._expert_tokens_sent = -float("inf")  # time.monotonic() when last in stats
        self.intake = RequestIntake(
            config, model_config.vocab_size, checkpoint, self.runner, self.connector
        )
        self._sequence_ids: dict[str, list[str]] = {}  # user request id -> its sequences
        self.num_sequences_received = 0
        self.num_preparing = 0  # requests the frontend said were on their way
        logger.info("engine ready in %.2f s", time.perf_counter() - start)

    def _allocate_kv_cache(self) -> int:
        """Sizes the KV pool from the budget (per rank), allocates it; its block count."""
        config = self.config
        num_blocks = self.runner.kv_cache_budget() // self.runner.kv_block_bytes
        min_blocks = -(-self.max_model_len // config.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"kv_cache_memory fits {num_blocks} blocks of {config.block_size} tokens, "
                f"fewer than one sequence of max_model_len={self.max_model_len} needs "
                f"({min_blocks}); raise kv_cache_memory or lower max_model_len"
            )
        # a prefill worker's KV lives in shared memory, for decode workers on its host; a
        # model over ranks keeps every rank's there when connectors move it (rank 0 runs
        # them: ember.kv.layout)
        shared = config.kv_role == "prefill" or (config.world_size > 1 and config.moves_kv)
        self.runner.allocate_kv_cache(num_blocks, shared=shared)
        startup.mark("kv cache")
        return num_blocks

    def _make_connector(self, config: EngineConfig) -> MultiConnector:
        context = ConnectorContext(config, self.runner.worker_kv, self._kv_identity(), KVStats())
        connector = make_connector(config.kv_connectors, context)
        tiers = connector.get("tiers")
        self.kv_store: TieredStore | None = tiers.store if tiers is not None else None
        self.kv_cache.pool.on_evict = connector.block_evicted
        return connector

    def _kv_identity(self) -> str:
        """What the KV this engine computes depends on: the checkpoint, the cache layout,
        the dtypes, the device's kind and the precision of the matmuls (ember.kv.tiers keys
        blocks by it)."""
        runner = self.runner
        kv = runner.worker_kv
        tensors, pieces = (kv.tensors, kv.pieces) if kv else (runner.kv_caches, runner.kv_pieces)
        layout = [
            (tuple(piece), tuple(t.shape[:1] + t.shape[2:]), str(t.dtype))
            for piece, t in zip(pieces, tensors, strict=True)
        ]
        return (
            f"v1|{self.checkpoint.identity()}|{layout}|block {self.config.block_size}|"
            f"{runner.dtype}|{runner.weight_dtype}|prefill {runner.prefill_precision}|"
            f"int8 decode {runner.int8_decode}|bf16 attention {runner.bf16_attention}|"
            f"{runner.device.type}"
        )

    def close(self) -> None:
        """Stops the KV connectors (endpoint, threads) and removes the shared-memory KV
        file, if any."""
        try:
            self.drain()
        except Exception:  # a failed rank: nothing left to finish
            logger.debug("steps in flight dropped at close", exc_info=True)
        self.connector.close()
        self.runner.close()
        if self.speculator is not None:
            self.speculator.proposer.close()

    @classmethod
    def from_config(cls, config: EngineConfig, checkpoint: Checkpoint | None = None) -> EngineCore:
        """Loads `checkpoint`, by default the one `config.model` names (fetching the
        default model if needed)."""
        from ember.loader.default_models import resolve_model

        torch.manual_seed(config.seed)
        checkpoint = checkpoint or open_checkpoint(resolve_model(config.model))
        return cls(config, ModelConfig.from_hf(checkpoint.hf_config), checkpoint)

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queues a request's sequences; a ValueError leaves nothing queued."""
        self.idle.served()
        self.num_preparing = core_request.num_preparing
        self.num_sequences_received += core_request.params.n
        if core_request.request_id in self._sequence_ids:
            raise ValueError(f"request_id {core_request.request_id!r} is already in use")
        requests = self.intake.make_sequences(core_request)
        self._sequence_ids[core_request.request_id] = [r.request_id for r in requests]
        for request in requests:
            self.scheduler.add(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        """Ends user requests (all their sequences) or single sequences, at any moment
        (one in a step in flight, once that step is finished)."""
        busy = self._busy()
        for request_id in request_ids:
            sequences = self._sequence_ids.get(request_id, [request_id])
            if busy.keys() & set(sequences):
                self._aborts_due.add(request_id)
                continue
            for sequence_id in sequences:
                aborted = self.scheduler.abort(sequence_id)
                if aborted is not None and self.speculator is not None:
                    self.speculator.forget(aborted, finished=False)
            self._forget(request_id)
            self.connector.drop_hold(request_id)  # a prefill the frontend will not hand over

    def _forget(self, sequence_id: str) -> None:
        """Drops a user request's entry once none of its sequences is live."""
        user_id = sequence_id.rpartition("#")[0] or sequence_id
        ids = self._sequence_ids.get(user_id, ())
        if not any(i in self.scheduler.requests for i in ids):
            self._sequence_ids.pop(user_id, None)

    def has_unfinished(self) -> bool:
        return (
            self.scheduler.num_unfinished > 0
            or self.connector.num_loading > 0
            or bool(self._in_flight)
        )

    def has_idle_work(self) -> bool:
        """Whether an idle moment has a use (ember.engine.idle)."""
        return self.idle.pending()

    def idle_work(self) -> None:
        """One slice of it (milliseconds); call only when no step is due."""
        self.idle.step()

    def hold_ms(self) -> float:
        """How long the next step should wait for requests the frontend is preparing (0:
        none). Only an idle engine waits (nothing running, no step in flight), and only
        while its oldest waiting request arrived less than `batch_wait_ms` ago: requests
        that come together then share a step (a burst of four sessions' prompts: one step
        instead of two) at the cost of the first one's wait."""
        waiting = self.scheduler.waiting
        if not self.num_preparing or not waiting or self.scheduler.running or self._in_flight:
            return 0.0
        waited_ms = (time.monotonic() - min(r.arrival_time for r in waiting)) * 1e3
        return max(self.config.batch_wait_ms - waited_ms, 0.0)

    def has_runnable(self) -> bool:
        """Work a step can do now (not only waiting for KV to arrive, or for the cluster
        store to say what it holds)."""
        waiting = len(self.scheduler.waiting) - self.connector.num_looking_up
        return bool(self.scheduler.running) or waiting > 0 or bool(self._in_flight)

    def tier_writes(self) -> int:
        """Blocks written to the tiers below the pool so far (they go on after a step)."""
        store = self.kv_store
        if store is None:
            return 0
        return store.stats.disk.writes + store.stats.cluster.writes

    def holds_kv(self) -> bool:
        """Finished prefills' blocks wait for decode workers (steps free them when done)."""
        return self.connector.num_held > 0

    def step(self) -> list[EngineCoreOutput]:
        if self.steps_in_flight > 1:
            return self._pipelined_step()
        if self._in_flight:  # a prompt's prefill in slices, decodes between them
            return self._sliced_step()
        drafts = self._drafts()  # timed on their own (the proposer's cost)
        start = time.perf_counter()
        sched_out = self.scheduler.schedule(drafts)
        if sched_out.empty:
            return []
        now = self._slice_prompts(sched_out, start)
        if now is not None:  # its prompts went in slices
            if now.empty:
                return self._sliced_step()
            sched_out = now  # decodes that must run now
        shape = sched_out.shape()
        predicted_ms = self.step_cost.predict_ms(shape)
        step = self.runner.execute(sched_out)
        return self._update(InFlight(sched_out, None, shape, predicted_ms, start), step)

    @property
    def target_itl_ms(self) -> float:
        """The ITL target prompts are sliced for (0: off; ember.engine.prompt_slicer)."""
        return self.slicer.target_itl_ms

    def _slice_prompts(self, sched_out: SchedulerOutput, start: float) -> SchedulerOutput | None:
        """`target_itl_ms`: puts this step's prompt chunks in flight where the slicer says
        to; the decodes that must run now (empty: none), or None where it did not."""
        sliced = self.slicer.slice(sched_out)
        if sliced is None:
            return None
        prompts, pending = sliced.prompts, sliced.pending
        self._in_flight.append(InFlight(prompts, pending, sliced.shape, sliced.predicted_ms, start))
        self.step_stats.num_sliced += 1
        return sliced.now

    def _sliced_step(self) -> list[EngineCoreOutput]:
        """With a prompt step in slices: its slices, until the running decodes (all but the
        prompts in flight) are due a step of their own, the next slice and a decode step
        after it passing `target_itl_ms` since their last tokens; that step's tokens, or
        the prompts' once their last slice has run. A slice runs after every decode step,
        so that the prompts move on however long a slice takes."""
        pending = self._in_flight[0].pending
        while True:
            decoding = [
                r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1
            ]  # (the prompts in flight have more than one token to compute)
            if decoding and not pending.decoded:
                if self.slicer.decode_due(pending, len(decoding)):
                    start = time.perf_counter()
                    busy = self._busy()
                    out = self.scheduler.schedule(self._drafts(), busy=busy, decodes_only=True)
                    if not out.empty:
                        pending.decoded = True
                        shape = out.shape()
                        step = self.runner.execute(out)
                        done = InFlight(out, None, shape, self.step_cost.predict_ms(shape), start)
                        return self._update(done, step)
            pending.decoded = False
            if self.runner.run_slice(pending):
                return self._finish_oldest()

    def _pipelined_step(self) -> list[EngineCoreOutput]:
        """Pipeline parallel: steps are submitted until `steps_in_flight` are, each of the
        requests no other step in flight holds (and a share of them, so that the running
        requests spread over the steps); then the oldest is finished and its tokens
        returned. While the later stages run one step, the first stage runs the next."""
        scheduler = self.scheduler
        while len(self._in_flight) < self.steps_in_flight:
            busy = self._busy()
            share = -(-(len(scheduler.running) + len(scheduler.waiting)) // self.steps_in_flight)
            start = time.perf_counter()
            sched_out = scheduler.schedule(busy=busy, max_scheduled=max(share, 1))
            if sched_out.empty:
                break
            shape = sched_out.shape()
            self.step_stats.num_overlapped += bool(self._in_flight)
            pending = self.runner.submit(sched_out)
            self._in_flight.append(
                InFlight(sched_out, pending, shape, self.step_cost.predict_ms(shape), start)
            )
        if not self._in_flight:
            return []
        return self._finish_oldest()

    def _finish_oldest(self) -> list[EngineCoreOutput]:
        """Finishes the oldest step in flight: its tokens, then the aborts that waited
        for it."""
        oldest = self._in_flight.popleft()
        waiting = {i: self._sequence_ids.get(i, [i]) for i in self._aborts_due}
        outputs = self._update(oldest, self.runner.finish(oldest.pending))
        # aborts that waited for this step (their sequences were in flight)
        busy = self._busy()
        due = [i for i, sequences in waiting.items() if busy.keys().isdisjoint(sequences)]
        if due:
            self._aborts_due.difference_update(due)
            self.abort_requests(due)
            dropped = {s for i in due for s in waiting[i]}
            outputs = [o for o in outputs if o.request_id not in dropped]
        return outputs

    def _busy(self) -> dict[str, int]:
        """The sequences in steps not yet finished (pipeline parallel, or a prompt step in
        slices), with their tokens in those steps."""
        busy: dict[str, int] = {}
        for step in self._in_flight:
            for sched in step.out.scheduled:
                request_id = sched.request.request_id
                busy[request_id] = busy.get(request_id, 0) + sched.num_new_tokens
        return busy

    def drain(self) -> None:
        """Finishes the steps in flight, dropping their tokens (before close)."""
        while self._in_flight:
            oldest = self._in_flight.popleft()
            if isinstance(oldest.pending, SlicedStep):
                while not self.runner.run_slice(oldest.pending):
                    pass
            self.scheduler.update(oldest.out, self.runner.finish(oldest.pending).sampled())

    def _update(self, done: InFlight, step) -> list[EngineCoreOutput]:
        """Applies a finished step: its tokens to the requests, its time to the stats."""
        sched_out, shape = done.out, done.shape
        for sched in sched_out.scheduled:
            if (more := step.prompt_logprobs.get(sched.request.request_id)) is not None:
                sched.request.prompt_logprobs.extend(more)
        sampled = step.sampled()
        logprobs = dict(zip(step.request_ids, step.logprobs, strict=True))
        self._observe_drafts(sched_out, sampled)
        updated, finished = self.scheduler.update(sched_out, sampled)
        if self.speculator is not None:
            for sched in sched_out.scheduled:
                if (features := step.features.get(sched.request.request_id)) is not None:
                    self.speculator.proposer.take_features(sched.request, *features)
            for request in finished:
                self.speculator.forget(request)
        measured_ms = (time.perf_counter() - done.start) * 1e3
        if shape.num_decode_rows:
            self.slicer.mark_decoded()
        if isinstance(done.pending, SlicedStep):  # its own time, not the decodes' between
            measured_ms = done.pending.own_ms()
        if done.pending is None or isinstance(done.pending, SlicedStep):
            self.step_cost.observe(shape, measured_ms)  # (a pipelined one's has the others')
        if self.speculator is not None:
            self.speculator.observe_step(shape, len(sched_out.scheduled), measured_ms)
        self.step_stats.record(sched_out.prefill_cap, shape, done.predicted_ms, measured_ms)
        outputs = []
        for update in updated:
            request = update.request
            entries = logprobs[request.request_id]
            first = request.num_output_tokens == len(update.new_token_ids)
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=update.new_token_ids,
                    new_logprobs=None if entries is None else entries[: len(update.new_token_ids)],
                    finish_reason=request.status.value if request.status.finished else None,
                    num_cached_tokens=request.num_cached_tokens,
                    queue_time=_queue_time(request) if first else None,
                    kv_transfer_params=request.handed_over,
                    prompt_logprobs=request.prompt_logprobs if first else None,
                )
            )
            if request.status.finished:
                self._forget(request.request_id)
        return outputs

    def _drafts(self) -> dict[str, list[int]] | None:
        """Draft tokens for the running requests that decode (speculative decoding)."""
        if self.speculator is None:
            return None
        decoding = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        return self.speculator.propose(decoding, self.max_model_len)

    def _observe_drafts(self, sched_out: SchedulerOutput, sampled: dict[str, list[int]]) -> None:
        """Tells the speculator how many of each request's drafts were accepted."""
        for sched in sched_out.scheduled:
            if sched.spec_token_ids:
                num_accepted = len(sampled[sched.request.request_id]) - 1
                self.speculator.observe(sched.request, len(sched.spec_token_ids), num_accepted)

    def stats(self) -> EngineStats:
        sched, kv = self.scheduler, self.connector
        queued = sum(
            max(r.num_prompt_tokens - r.num_computed_tokens, 0)
            for r in list(sched.waiting) + sched.running
        )
        return EngineStats(
            num_waiting=len(sched.waiting),
            num_running=len(sched.running),
            num_queued_prefill_tokens=queued,
            kv_blocks_used=self.kv_cache.num_blocks - self.kv_cache.num_free_blocks,
            kv_blocks_total=self.kv_cache.num_blocks,
            kv_block_bytes=self.runner.kv_block_bytes,
            prefix_cache_queries=self.kv_cache.stats.queries,
            prefix_cache_hits=self.kv_cache.stats.hits,
            num_sequences_received=self.num_sequences_received,
            num_prompt_tokens_computed=sched.num_prompt_tokens_computed,
            num_waiting_for_kv=kv.num_loading,
            kv_loads_ok=kv.stats.loads_ok,
            kv_loads_failed=kv.stats.loads_failed,
            kv_bytes_received=kv.stats.bytes_received,
            kv_load_seconds=kv.stats.load_seconds_total,
            kv_held=kv.num_held,
            kv_tiers=None if self.kv_store is None else self.kv_store.stats.as_dict(),
            kv_holds_expired=kv.stats.holds_expired,
            kv_bytes_sent=kv.bytes_sent,
            num_steps=self.step_stats.num_steps,
            step_seconds=self.step_stats.measured_ms / 1e3,
            step_predicted_seconds=self.step_stats.predicted_ms / 1e3,
            step_error_seconds=self.step_stats.error_ms / 1e3,
            num_capped_steps=self.step_stats.num_capped,
            num_sliced_steps=self.step_stats.num_sliced,
            last_prefill_cap=self.step_stats.last_prefill_cap,
            target_itl_ms=self.target_itl_ms,
            expert_tokens=self._expert_tokens(),
            spec_decode=None if self.speculator is None else self.speculator.stats.as_dict(),
        )

    def _expert_tokens(self) -> list[tuple[int, list[int]]] | None:
        """The MoE layers' token counts, if a second has passed or the engine is idle."""
        now = time.monotonic()
        if not self.runner.moe_layers or (
            now - self._expert_tokens_sent < 1.0 and self.has_unfinished()
        ):
            return None
        self._expert_tokens_sent = now
        return self.runner.expert_tokens()


@dataclass
class InFlight:
    """A scheduled step and what the runner gave for it (`pending`: submitted, not yet
    finished, under pipeline parallelism; None: run through already)."""

    out: SchedulerOutput
    pending: PendingStep | None
    shape: StepShape
    predicted_ms: float
    start: float


class StepStats:
    """Step times since start (predicted, measured) and the step budget's chunk caps."""

    def __init__(self) -> None:
        self.num_steps = 0
        self.measured_ms = self.predicted_ms = self.error_ms = 0.0
        self.num_capped = 0
        self.num_sliced = 0  # prompt steps run a slice of layers at a time (target_itl_ms)
        self.last_prefill_cap = 0  # of the last step the budget capped
        self.num_overlapped = 0  # steps submitted while another was in flight (pipeline)

    def record(
        self, prefill_cap: int | None, shape: StepShape, predicted_ms: float, measured_ms: float
    ) -> None:
        self.num_steps += 1
        self.measured_ms += measured_ms
        self.predicted_ms += predicted_ms
        self.error_ms += abs(measured_ms - predicted_ms)
        if prefill_cap is not None:
            self.num_capped += 1
            self.last_prefill_cap = prefill_cap
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "step: %d decodes, %d prefill tokens (cap %s): predicted %.1f ms, took %.1f ms",
                shape.num_decode_rows, shape.num_prefill_tokens, prefill_cap,
                predicted_ms, measured_ms,
            )  # fmt: skip


def _queue_time(request: Request) -> float | None:
    if request.first_scheduled_time is None:
        return None
    return request.first_scheduled_time - request.arrival_time


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    """The context length served: the model's, capped by the user's and by a sliding window
    (attention over a window is not implemented, so sequences never outgrow it)."""
    limit = model_config.max_position_embeddings
    if model_config.sliding_window is not None:
        limit = min(limit, model_config.sliding_window)
    if config.max_model_len is not None:
        if config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's context of {limit}"
            )
        limit = config.max_model_len
    return limit

"""`target_itl_ms`: a prompt step's layers run a slice at a time, decode steps between.

A step with prompt chunks beside running decodes gives the decodes their next token only
when the whole step is done; where that is predicted to come later than the target, the
engine core puts the chunks in flight (`ModelRunner.submit_sliced`), runs their layers a
slice at a time, and a decode step whenever the next slice would carry the decodes past
the target since their last token. This object decides both (the core runs the steps);
its predictions are the step cost model's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from ember.engine.kv_cache import KVCacheManager
from ember.engine.model_runner import ModelRunner, SlicedStep
from ember.engine.scheduler import SchedulerOutput
from ember.engine.step_cost import StepCostModel, StepShape

# a prompt's slices take about this share of the target each, so that the decodes get
# their step close to it (with quarters, the trace's gaps were 75-100 ms at a 100 ms
# target: more decode steps than it needs)
SLICE_SHARE = 0.1
# target_itl_ms auto: this share of the time a prompt chunk of AUTO_TARGET_TOKENS alone is
# predicted to take (the step cost model: this machine's speed; the calibration times such
# a prompt). The targets that held the conversation trace's ITL p90 to half vLLM's without
# giving up its TTFT p90 were 0.72-0.84 of a 512-token prompt's time on a Zen 5 EPYC and
# 0.85-0.94 on an AMX Xeon (a 1,024-token prompt's halved); on a Zen 4 EPYC, where the
# step budget alone held the gaps under half vLLM's, 0.8 (232 ms) bought 0.42-0.44x
# against 0.44-0.50x for a TTFT p90 of 1.12-1.20x against 0.86-0.90x. So the share sits
# at their boundary: ~95 ms on the Xeon, ~140 on the Zen 5, ~220-280 on the Zen 4, about
# its budget. Before the calibration the prior's slow costs put it past the budget.
AUTO_TARGET_SHARE = 0.85
AUTO_TARGET_TOKENS = 512


@dataclass
class Slices:
    """A step's prompt chunks put in flight, and the decodes that must run now."""

    prompts: SchedulerOutput
    pending: SlicedStep
    shape: StepShape
    predicted_ms: float
    now: SchedulerOutput  # empty: the decodes were left out, to be scheduled when due


class PromptSlicer:
    def __init__(
        self,
        target_itl_ms: float | None,  # None: auto; 0: off
        step_cost: StepCostModel,
        runner: ModelRunner,
        kv_cache: KVCacheManager,
    ) -> None:
        self._target_itl_ms = target_itl_ms
        self.step_cost = step_cost
        self.runner = runner
        self.kv_cache = kv_cache
        self._decoded_at = time.perf_counter()  # the end of the last step with decodes

    @property
    def target_itl_ms(self) -> float:
        """The ITL target prompts are sliced for (0: off): the configured one, or where
        that is auto, AUTO_TARGET_SHARE of a AUTO_TARGET_TOKENS chunk's predicted time."""
        if self._target_itl_ms is not None:
            return self._target_itl_ms
        n = AUTO_TARGET_TOKENS
        chunk = StepShape(n, 0, StepShape.chunk_pairs(0, n))
        return AUTO_TARGET_SHARE * self.step_cost.predict_ms(chunk)

    def mark_decoded(self) -> None:
        """A step with decodes has just ended."""
        self._decoded_at = time.perf_counter()

    def decode_age_ms(self) -> float:
        """Since the running decodes last got tokens (the end of the last step with decodes)."""
        return (time.perf_counter() - self._decoded_at) * 1e3

    def slice(self, sched_out: SchedulerOutput) -> Slices | None:
        """Submits this step's prompt chunks to run a slice of layers at a time, where the
        step with the decodes beside them is predicted to give the decodes their next
        token later than the target; None where not. Its decodes are then left out, to be
        scheduled again when due (what the scheduler gave them stays theirs), unless one's
        token fills its block: scheduling registered that block for prefix hits, so they
        run now (`Slices.now`), lest an abort or a preemption free it unwritten."""
        if self._target_itl_ms == 0.0:  # (every step asks: nothing made when it is off)
            return None
        chunks = [s for s in sched_out.scheduled if s.num_new_tokens > 1]
        decodes = [s for s in sched_out.scheduled if s.num_new_tokens == 1]
        if not chunks or not decodes:
            return None
        target_ms = self.target_itl_ms
        if target_ms <= 0:
            return None
        whole_ms = self.step_cost.predict_ms(sched_out.shape())
        if self.decode_age_ms() + whole_ms <= target_ms:
            return None
        prompts = SchedulerOutput(chunks, prefill_cap=sched_out.prefill_cap)
        shape = prompts.shape()
        predicted_ms = self.step_cost.predict_ms(shape)
        # slices of a tenth of the target: a decode step comes close to it, no sooner
        num_layers = self.runner.num_local_layers
        per_layer_ms = max(predicted_ms / num_layers, 1e-3)
        per_slice = min(max(int(target_ms * SLICE_SHARE / per_layer_ms), 1), num_layers)
        pending = self.runner.submit_sliced(prompts, per_slice)
        pending.slice_ms = per_slice * per_layer_ms
        block_size = self.kv_cache.block_size
        fills_block = self.kv_cache.enable_prefix_caching and any(
            (s.start + 1) % block_size == 0 for s in decodes
        )
        now = SchedulerOutput(decodes, sched_out.preempted) if fills_block else SchedulerOutput()
        return Slices(prompts, pending, shape, predicted_ms, now)

    def decode_due(self, pending: SlicedStep, num_decoding: int) -> bool:
        """Whether `num_decoding` running decodes are due a step before the next slice:
        that slice and a decode step after it would pass the target since their tokens."""
        decode_ms = self.step_cost.predict_ms(StepShape(num_decode_rows=num_decoding))
        next_ms = pending.next_slice_ms()
        return self.decode_age_ms() + next_ms + decode_ms > self.target_itl_ms

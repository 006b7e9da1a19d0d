"""Steps a freshly started engine times on itself while idle, for its step cost model.

The step budget plans each step with a cost model learned from the steps it times
(ember.engine.step_cost). Before any, it has only the prior, a slow CPU's costs: a fresh
server on the 2-core dev box predicted its first 512-token step at 1,087 ms (it took 162)
and capped the prompt chunks of its first mixed steps to fit the budget by that. And a
step of a size oneDNN has not seen yet pays for building its kernels (a few ms a matmul).

So once the KV pool has its pages (the idle work before this one), the engine runs a
short script of synthetic requests through the model, a step per idle slice: two prompts
of 512 tokens (the first only warms up), then a prompt in two 256-token chunks beside
the first two's decodes, then decodes alone, of two sizes (SCRIPT). Every step after a
shape's first is observed by the cost model as a served step would be, and then the
prior's costs are let go (`StepCostModel.calibrated`): four shapes of step pin down its
four coefficients. The requests are the calibration's
own: their blocks come from the pool (never cached for prefix hits) and go back when the
script ends, their tokens go nowhere, and the scheduler never sees them. A request that
arrives meanwhile waits for at most the step under way (~130 ms on the dev box for the
512-token one); the script is dropped then, its blocks given back, and never resumes:
from there on the served steps teach the model.

Only a single process's plain CPU engine calibrates: no ranks, no pipeline, no
speculative decoding (CUDA engines would take the same steps, but that is not yet checked
on a GPU). A step that fails drops the script with a warning; the engine serves on.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import ScheduledRequest, SchedulerOutput
from ember.engine.step_cost import StepCostModel
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.engine")

PROMPT_TOKENS = 512  # the first two prompts; the third comes in two chunks of half


@dataclass(frozen=True)
class Step:
    """One scripted step: prompt chunks (request index, tokens) and decodes (indexes)."""

    chunks: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()
    observe: bool = True


SCRIPT = (  # a shape's first step only warms up (oneDNN builds its kernels for new sizes)
    Step(chunks=((0, PROMPT_TOKENS),), observe=False),
    Step(chunks=((1, PROMPT_TOKENS),)),
    Step(chunks=((2, PROMPT_TOKENS // 2),), decodes=(0, 1), observe=False),
    Step(chunks=((2, PROMPT_TOKENS // 2),), decodes=(0, 1)),  # after 256 computed
    Step(decodes=(0, 1, 2), observe=False),
    Step(decodes=(0, 1, 2)),
    Step(decodes=(0,)),  # two decode sizes: a step's base apart from a row's cost
    Step(decodes=(0, 1, 2)),
    Step(decodes=(0,)),
)


class Calibrator:
    """Runs SCRIPT a step per `step()` call; `done` once run or dropped."""

    def __init__(
        self,
        runner,
        kv_cache: KVCacheManager,
        cost_model: StepCostModel,
        max_model_len: int,
        vocab_size: int,
        enabled: bool = True,
    ) -> None:
        self.runner = runner
        self.kv_cache = kv_cache
        self.cost_model = cost_model
        # room for the script's longest sequence and enough blocks for all of them
        need = PROMPT_TOKENS + len(SCRIPT) + 1
        blocks = 3 * (-(-need // kv_cache.block_size))
        fits = max_model_len > need and kv_cache.num_free_blocks >= blocks
        self._left = deque(SCRIPT if enabled and fits else ())
        params = SamplingParams(temperature=0.0, max_tokens=len(SCRIPT), ignore_eos=True)
        self._requests = [
            Request(
                f"calibration-{i}",
                [(i * 7919 + t * 104729) % vocab_size for t in range(PROMPT_TOKENS)],
                params,
                len(SCRIPT),
            )
            for i in range(3)
        ]
        self.num_observed = 0

    @property
    def done(self) -> bool:
        return not self._left

    def drop(self) -> None:
        """Gives up what is left (a request arrived) and gives the blocks back."""
        if self._left:
            logger.debug("step cost calibration dropped after %d steps", self.num_observed)
            self._end()

    def _end(self) -> None:
        self._left.clear()
        for request in self._requests:
            self.kv_cache.free(request)

    def step(self) -> None:
        """Runs the next scripted step and has the cost model observe its time."""
        if not self._left:
            return
        script = self._left.popleft()
        try:
            out = self._schedule(script)
            if out is None:  # the pool is in use after all: leave it to requests
                self._end()
                return
            start = time.perf_counter()
            sampled = self.runner.execute(out).sampled()
            measured_ms = (time.perf_counter() - start) * 1e3
        except Exception:  # never the engine's end: the served steps will teach the model
            logger.warning("step cost calibration failed; dropped", exc_info=True)
            self._end()
            return
        shape = out.shape()  # before the requests move on
        for sched in out.scheduled:
            request = sched.request
            request.num_computed_tokens += sched.num_new_tokens
            request.token_ids += sampled.get(request.request_id, [])[:1]
        if script.observe:
            self.cost_model.observe(shape, measured_ms)
            self.num_observed += 1
        if not self._left:
            self._end()
            self.cost_model.calibrated()
            logger.debug(
                "step cost calibrated on %d steps: %s", self.num_observed,
                self.cost_model.coefficients.round(3).tolist(),
            )  # fmt: skip

    def _schedule(self, script: Step) -> SchedulerOutput | None:
        """The step's rows with their blocks (None: the pool has none to spare)."""
        rows = [(self._requests[i], n) for i, n in script.chunks]
        rows += [(self._requests[i], 1) for i in script.decodes]
        out = SchedulerOutput()
        for request, num_new in rows:
            if self.kv_cache.allocate_slots(request, num_new, cache=False) is None:
                return None
            block_ids = self.kv_cache.block_ids(request.request_id)
            out.scheduled.append(ScheduledRequest(request, num_new, block_ids))
        return out

"""Steps a freshly started engine times on itself while idle, for its step cost model.

The step budget plans each step with a cost model learned from the steps it times
(ember.engine.step_cost). Before any, it has only the prior, a slow CPU's costs: a fresh
server on the 2-core dev box predicted its first 512-token step at 1,087 ms (it took 162)
and capped the prompt chunks of its first mixed steps to fit the budget by that. And a
step of a size oneDNN has not seen yet pays for building its kernels (a few ms a matmul).

So once the KV pool has its pages (the idle work before this one), the engine runs a
short script of synthetic requests through the model, a step per idle slice: two prompts
of 512 tokens (the first only warms up), then a prompt in two 256-token chunks beside
the first two's decodes, then decodes alone, of two sizes, then two chunks of LONG_CHUNK
tokens after LONG_CONTEXT (less where max_model_len is shorter): SCRIPT. Every step after
a shape's first is observed by the cost model as a served step would be, and then the
prior's costs are let go (`StepCostModel.calibrated`): five shapes of step pin down its
four coefficients.

The long chunks are what tell a query-key pair's cost from a token's. Their request's
first LONG_CONTEXT tokens are taken as computed, never computed: the attention reads
their blocks as they are (zeros in a fresh pool; its time does not depend on the
values), so they cost two steps, not four 512-token prefills. Without them (a
max_model_len or pool too small for them: SHORT_SCRIPT) the pairs' cost keeps the
prior's pull until served long contexts teach it. Calibrated on short contexts alone,
SmolLM2 on a 2-core EPYC predicted a 300-token chunk after 2,000 tokens beside 4 decodes
(~425 ms by the conversation trace's fit) at 282-306 ms, and so would cap such a chunk
at 243-264 tokens for a 250 ms budget, a step of ~370 ms; with them it predicted 365-503
ms and capped it at 145-205 (docs/benchmarks.md).

The requests are the calibration's
own: their blocks come from the pool (never cached for prefix hits) and go back when the
script ends, their tokens go nowhere, and the scheduler never sees them. A request that
arrives meanwhile waits for at most the step under way (~130 ms on the dev box for the
512-token one); the script is dropped then, its blocks given back, and never resumes:
from there on the served steps teach the model.

A step timed while another process had part of the CPU says nothing about this machine:
beside one busy process a 512-token prefill took 5x its time on the 2-core dev box, and a
fresh server started beside another (a second engine, vLLM loading) learned costs
1.5-3x its own and capped its first served chunks by them. So an observed step whose
threads got under CONTENDED_SHARE of their CPU time (the process's CPU seconds over the
step's wall time x threads: 0.97-1.0 alone, 0.6 beside one busy process, 0.5 beside two)
is not observed but run again later, after BACKOFF_S (jittered; the idle work goes on
meanwhile); once those are spent the box is taken as busy and its steps observed as they
come. (A fresh server started beside vLLM, which kept the CPU busy for ~80 s loading:
seven reruns, then the load came and dropped the script; its first steps learned from
the prior, no worse than from the busy steps.)

Only a single process's plain CPU engine calibrates: no ranks, no pipeline, no
speculative decoding (CUDA engines would take the same steps, but that is not yet checked
on a GPU). A step that fails drops the script with a warning; the engine serves on.
"""

from __future__ import annotations

import logging
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import ScheduledRequest, SchedulerOutput
from ember.engine.step_cost import StepCostModel
from ember.sampling_params import SamplingParams

logger = logging.getLogger("ember.engine")

PROMPT_TOKENS = 512  # the first two prompts; the third comes in two chunks of half
# the fourth request: two chunks of LONG_CHUNK tokens after LONG_CONTEXT taken as computed
# (less where max_model_len is shorter, down to LONG_CONTEXT_MIN: at 640 a chunk's token
# attends 2.5x the pairs a 512-token prompt's does)
LONG_CONTEXT, LONG_CONTEXT_MIN, LONG_CHUNK = 1536, 640, 128
# an observed step whose threads had less than this share of their CPU time ran beside
# another busy process (measured on the dev box, SmolLM2: 0.97-1.0 alone, 0.57-0.61 beside
# one process spinning on a core, 0.45-0.5 beside two)
CONTENDED_SHARE = 0.85
# steps shorter than this spend too much of their time waking threads to be judged
MIN_JUDGED_MS = 10.0
# the waits before each rerun of a step taken while the CPU was shared; then it is observed
BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 30.0, 30.0)  # two minutes in all


class ContentionBackoff:
    """For idle work that times the CPU (the calibration's steps, ember.engine.matmul_split's
    matmuls): whether a timing was another process's as much as this machine's (its
    threads had under CONTENDED_SHARE of their CPU time), and then when to try again
    (BACKOFF_S, jittered: engines started together drift apart); once the waits are spent
    the box is taken as busy and its timings kept as they come."""

    def __init__(self, what: str) -> None:
        self.what = what  # for the log
        self.num_contended = 0  # timings taken again because the CPU was shared
        self._resume_at = 0.0  # time.monotonic() before which none is taken
        self._jitter = random.Random()  # its own: the process's random state is left alone

    @property
    def ready(self) -> bool:
        return time.monotonic() >= self._resume_at

    def contended(self, measured_ms: float, share: float) -> bool:
        """Whether a timing of `measured_ms` whose threads had `share` of their CPU time
        is to be taken again (after the next wait)."""
        if share >= CONTENDED_SHARE or measured_ms < MIN_JUDGED_MS:
            return False
        if self.num_contended >= len(BACKOFF_S):
            return False  # a busy box: its timings are what serving will see
        wait = BACKOFF_S[self.num_contended] * (1.0 + self._jitter.random() / 2)
        self.num_contended += 1
        self._resume_at = time.monotonic() + wait
        logger.debug(
            "%s of %.1f ms had %.0f%% of its threads' CPU time: again in %.1f s",
            self.what, measured_ms, 100 * share, wait,
        )  # fmt: skip
        return True


@dataclass(frozen=True)
class Step:
    """One scripted step: prompt chunks (request index, tokens) and decodes (indexes)."""

    chunks: tuple[tuple[int, int], ...] = ()
    decodes: tuple[int, ...] = ()
    observe: bool = True


SHORT_SCRIPT = (  # a shape's first step only warms up (oneDNN builds its kernels for new sizes)
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
SCRIPT = SHORT_SCRIPT + (  # the first warms the kernels for its size, the second is timed
    Step(chunks=((3, LONG_CHUNK),), observe=False),
    Step(chunks=((3, LONG_CHUNK),)),  # after LONG_CONTEXT + LONG_CHUNK
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
        self.long_context = min(LONG_CONTEXT, max_model_len - 2 * LONG_CHUNK - 1)
        long_tokens = self.long_context + 2 * LONG_CHUNK
        blocks += -(-(long_tokens + 1) // kv_cache.block_size)
        self.long_steps = (
            self.long_context >= LONG_CONTEXT_MIN and kv_cache.num_free_blocks >= blocks
        )
        self.script = SCRIPT if self.long_steps else SHORT_SCRIPT
        self._left = deque(self.script if enabled and fits else ())
        params = SamplingParams(temperature=0.0, max_tokens=len(SCRIPT), ignore_eos=True)
        self._requests = [
            Request(
                f"calibration-{i}",
                [(i * 7919 + t * 104729) % vocab_size for t in range(length)],
                params,
                len(SCRIPT),
            )
            for i, length in enumerate([PROMPT_TOKENS] * 3 + [max(long_tokens, 1)])
        ]
        self._requests[3].num_computed_tokens = self.long_context  # not computed: the top
        self.num_observed = 0
        self.backoff = ContentionBackoff("calibration step")

    @property
    def done(self) -> bool:
        return not self._left

    @property
    def ready(self) -> bool:
        """A step is left and may run now (not waiting out a busy CPU)."""
        return bool(self._left) and self.backoff.ready

    @property
    def num_contended(self) -> int:
        """Steps run again because the CPU was shared."""
        return self.backoff.num_contended

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
            start, cpu = time.perf_counter(), time.process_time()
            sampled = self.runner.execute(out).sampled()
            wall = time.perf_counter() - start
            share = (time.process_time() - cpu) / (wall * torch.get_num_threads())
            measured_ms = wall * 1e3
        except Exception:  # never the engine's end: the served steps will teach the model
            logger.warning("step cost calibration failed; dropped", exc_info=True)
            self._end()
            return
        if script.observe and self.backoff.contended(measured_ms, share):
            self._left.appendleft(script)  # again later: the requests have not moved on
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
            self.cost_model.calibrated(pairs_seen=self.long_steps)
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

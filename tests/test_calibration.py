"""A fresh engine times a few synthetic steps while idle (ember.engine.calibration), so its
first steps under load are planned by its own costs; the pool, the prefix cache and the
requests served are as if it had not."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ember.config import EngineConfig
from ember.engine import calibration
from ember.engine.calibration import LONG_CHUNK, LONG_CONTEXT
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.engine.step_cost import ATTENTION, StepCoefficients, StepCostModel, StepShape
from ember.sampling_params import SamplingParams

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture
def make_core(tiny_checkpoint):
    cores = []

    def make(**options) -> EngineCore:
        defaults = dict(kv_cache_memory=64 << 20, max_model_len=1024, max_step_ms=250.0)
        config = EngineConfig(model=str(tiny_checkpoint("llama")), **{**defaults, **options})
        cores.append(EngineCore.from_config(config))
        return cores[-1]

    yield make
    for core in cores:
        core.close()


def idle(core: EngineCore) -> int:
    """Runs the idle work to its end, as an idle server does; returns the slices."""
    slices = 0
    while core.has_idle_work():
        core.idle_work()
        slices += 1
    return slices


def serve(core: EngineCore, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    """Each prompt's tokens, and every step's prefill cap, as the engine serves them."""
    for i, prompt in enumerate(prompts):
        core.add_request(EngineCoreRequest(f"r{i}", prompt, PARAMS, PARAMS.max_tokens, []))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    caps = []
    schedule = core.scheduler.schedule

    def recording(*args, **kwargs):
        out = schedule(*args, **kwargs)
        caps.append(out.prefill_cap)
        return out

    core.scheduler.schedule = recording
    while core.has_unfinished():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    tokens = {i: t for i, t in tokens.items() if i.startswith("r")}
    return list(tokens.values()), caps


@pytest.mark.parametrize("max_model_len", [700, 1024])
def test_an_idle_engine_calibrates_and_gives_everything_back(make_core, max_model_len):
    """Where the long-context chunks fit (max_model_len past LONG_CONTEXT_MIN + 2 chunks;
    this model's context, 1,024, leaves 767 tokens before them), they are among the
    steps observed and the pairs' prior is let go with the rest; else the script leaves
    them out and the pairs keep the prior's cost."""
    core = make_core(max_model_len=max_model_len)
    long_steps = max_model_len == 1024
    assert core.idle.calibrator.long_steps == long_steps
    context = core.idle.calibrator.long_context
    assert context == min(LONG_CONTEXT, max_model_len - 2 * LONG_CHUNK - 1)
    blocks = core.kv_cache.num_free_blocks
    assert np.allclose(core.step_cost.coefficients, StepCoefficients().as_array())
    seen = {}
    observe = core.step_cost.observe
    core.step_cost.observe = lambda shape, ms: (seen.setdefault(shape, ms), observe(shape, ms))
    script = core.idle.calibrator.script
    assert idle(core) > len(script)  # the prefault's slices, then the script's
    observed = sum(step.observe for step in script)
    assert core.step_cost.num_observed == core.idle.calibrator.num_observed == observed
    # this machine's costs: a tiny model's 512-token step takes a few ms, the prior says ~1 s
    prompt = StepShape(512, 0, StepShape.chunk_pairs(0, 512))
    assert StepCostModel().predict_ms(prompt) > 4 * seen[prompt]  # the prior: far off
    assert seen[prompt] / 2 < core.step_cost.predict_ms(prompt) < 2 * seen[prompt]
    # shapes: two with prompts, two of decodes alone, and the chunk after a long context
    chunk = StepShape(LONG_CHUNK, 0, StepShape.chunk_pairs(context + LONG_CHUNK, LONG_CHUNK))
    assert len(seen) == 4 + long_steps and (chunk in seen) == long_steps
    prior_pull = core.step_cost.fit._ridge[ATTENTION, ATTENTION]
    assert (prior_pull == 0) == long_steps
    assert core.kv_cache.num_free_blocks == blocks and core.kv_cache.check_integrity()
    assert all(not pool.cached for pool in core.kv_cache.pools)  # no prefix-cache entry
    assert core.kv_cache.stats.queries == 0 and core.step_stats.num_steps == 0


def test_calibrated_the_first_mixed_step_takes_the_whole_chunk(make_core):
    """Two streams decoding, then a 512-token prompt: by the prior (60 ms a step, 2 ms a
    token) the chunk beside the decodes is capped to fit 250 ms; calibrated, it is not.
    The tokens are the same either way."""
    prompts = [[5 + i for i in range(40)], [9 + i for i in range(40)]]
    long = [(7 * t) % 200 + 3 for t in range(512)]
    results = {}
    for calibrate in (False, True):
        core = make_core()
        while not core.idle.prefaulter.done:
            core.idle_work()
        if calibrate:
            idle(core)
        for i, prompt in enumerate(prompts):
            core.add_request(EngineCoreRequest(f"d{i}", prompt, PARAMS, 6, []))
        core.step()  # the two prompts; they decode from here
        results[calibrate] = serve(core, [long])
    (tokens_prior, caps_prior), (tokens_calibrated, caps_calibrated) = results[False], results[True]
    assert tokens_prior == tokens_calibrated and len(tokens_calibrated[0]) == 6
    assert caps_prior[0] is not None and caps_prior[0] < 512
    assert caps_calibrated[0] is None


def test_a_request_arriving_mid_script_drops_it_and_is_served_alike(make_core):
    core = make_core()
    while not core.idle.prefaulter.done:
        core.idle_work()
    free = core.kv_cache.num_free_blocks
    core.idle_work()  # the first scripted step: its blocks are taken
    assert not core.idle.calibrator.done and core.kv_cache.num_free_blocks < free
    prompt = [11 + i for i in range(30)]
    tokens, _ = serve(core, [prompt])  # add_request drops the script
    assert core.idle.calibrator.done and not core.has_idle_work()
    assert core.kv_cache.num_free_blocks == free and core.kv_cache.check_integrity()
    reference = make_core()
    assert serve(reference, [prompt])[0] == tokens


def test_what_cannot_calibrate_does_not(make_core):
    assert make_core(max_model_len=256).idle.calibrator.done  # the script's prompts do not fit
    assert make_core(speculative_method="ngram").idle.calibrator.done


def test_a_failing_step_drops_the_script_and_the_engine_serves_on(make_core, monkeypatch):
    core = make_core()
    while not core.idle.prefaulter.done:
        core.idle_work()
    free = core.kv_cache.num_free_blocks
    core.idle_work()  # a first step goes through
    monkeypatch.setattr(core.runner, "execute", lambda out: 1 / 0)
    core.idle_work()
    assert core.idle.calibrator.done and core.kv_cache.num_free_blocks == free
    monkeypatch.undo()
    tokens, _ = serve(core, [[3 + i for i in range(20)]])
    assert len(tokens[0]) == PARAMS.max_tokens


class SharedCpu:
    """time.process_time and time.monotonic for the calibration: while `busy`, the process
    gets no CPU time (another one has it); otherwise exactly its threads' wall time. The
    monotonic clock moves only when told."""

    def __init__(self) -> None:
        self.busy = False
        self.cpu = 0.0
        self.now = 1000.0
        self._last = time.perf_counter()

    def process_time(self) -> float:
        wall = time.perf_counter()
        if not self.busy:
            self.cpu += (wall - self._last) * torch.get_num_threads()
        self._last = wall
        return self.cpu

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def shared_cpu(monkeypatch) -> SharedCpu:
    cpu = SharedCpu()
    monkeypatch.setattr(calibration.time, "process_time", cpu.process_time)
    monkeypatch.setattr(calibration.time, "monotonic", cpu.monotonic)
    monkeypatch.setattr(calibration, "MIN_JUDGED_MS", 0.0)  # the tiny model's steps are short
    return cpu


def test_a_step_timed_while_the_cpu_is_shared_runs_again_later(make_core, shared_cpu):
    """A busy neighbour during an observed step: the step is not observed, the script
    waits out the backoff (the engine has no idle work then) and runs it again."""
    core = make_core()
    while not core.idle.prefaulter.done:
        core.idle_work()
    free = core.kv_cache.num_free_blocks
    times = []
    observe = core.step_cost.observe
    core.step_cost.observe = lambda shape, ms: (times.append(ms), observe(shape, ms))
    core.idle_work()  # the warm-up step (not observed)
    shared_cpu.busy = True
    core.idle_work()  # the first observed step, beside a busy process
    assert times == [] and core.idle.calibrator.num_contended == 1
    assert not core.idle.calibrator.ready and not core.idle.calibrator.done
    while core.has_idle_work():  # the rest of the idle work goes on meanwhile
        core.idle_work()
    assert core.idle.warmer.done and not core.idle.calibrator.done
    shared_cpu.busy = False
    shared_cpu.now += calibration.BACKOFF_S[0] * 1.5  # the longest jittered wait
    assert core.idle.calibrator.ready and core.has_idle_work()
    idle(core)
    observed = sum(step.observe for step in core.idle.calibrator.script)
    assert core.idle.calibrator.done and len(times) == core.idle.calibrator.num_observed == observed
    assert core.idle.calibrator.num_contended == 1
    assert core.kv_cache.num_free_blocks == free and core.kv_cache.check_integrity()


def test_on_a_box_that_stays_busy_the_steps_are_observed_as_they_come(make_core, shared_cpu):
    core = make_core()
    shared_cpu.busy = True
    for _ in range(1000):
        if core.idle.calibrator.done:
            break
        if core.has_idle_work():
            core.idle_work()
        else:
            shared_cpu.now += 10.0  # past any backoff
    calibrator = core.idle.calibrator
    assert calibrator.done and calibrator.num_contended == len(calibration.BACKOFF_S)
    assert calibrator.num_observed == sum(step.observe for step in calibrator.script)


def test_a_request_during_the_backoff_drops_the_script(make_core, shared_cpu):
    core = make_core()
    while not core.idle.prefaulter.done:
        core.idle_work()
    free = core.kv_cache.num_free_blocks
    shared_cpu.busy = True
    core.idle_work()
    core.idle_work()  # contended: waits
    assert not core.idle.calibrator.ready and core.kv_cache.num_free_blocks < free
    tokens, _ = serve(core, [[3 + i for i in range(20)]])
    assert len(tokens[0]) == PARAMS.max_tokens
    assert core.idle.calibrator.done and core.kv_cache.num_free_blocks == free

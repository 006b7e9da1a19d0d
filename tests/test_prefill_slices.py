"""A prompt's prefill a slice of layers at a time (`target_itl_ms`): the decodes running
beside it take steps of their own between the slices, the tokens stay transformers'
greedy ones, an abort of a prompt in slices waits for its last slice, and no KV block is
left behind. A target of a microsecond slices every prompt chunk beside a decode one
layer at a time, with a decode step after every slice (prefill made dear in the cost
model keeps chunks short, so that there are many)."""

from __future__ import annotations

import argparse

import pytest
from test_models import GREEDY, PROMPTS, SMALL_KV, hf_reference, token_ids
from test_scheduler import FakeRunner, make_request, make_scheduler, scheduled_tokens, tokens

from conftest import ARCHS
from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.engine.core import EngineCore
from ember.engine.messages import EngineCoreRequest
from ember.engine.step_cost import StepCoefficients, StepCostModel
from ember.engine_args import add_engine_args, engine_options

# every prompt chunk predicted at seconds: the step budget cuts chunks to the floor
DEAR = StepCoefficients(base=1.0, per_prefill_token=1e4, per_decode_row=1.0)


def use_cost_model(core: EngineCore, coefficients) -> None:
    """Every holder of the core's step cost model gets one fixed at `coefficients`."""
    model = StepCostModel(coefficients, prior_weight=1e12)
    core.step_cost = core.scheduler.cost_model = core.slicer.step_cost = model


def dear_prefill(core: EngineCore) -> None:
    use_cost_model(core, DEAR)


def record_events(core: EngineCore) -> list[str]:
    """'slice' for every slice run, 'decodes' / 'mixed' / 'prompts' for every step run
    whole, in order."""
    events: list[str] = []
    runner = core.runner
    run_slice, execute = runner.run_slice, runner.execute

    def timed_slice(step):
        events.append("slice")
        return run_slice(step)

    def timed_execute(out):
        kinds = {s.num_new_tokens > 1 for s in out.scheduled}
        events.append(
            {frozenset([False]): "decodes", frozenset([True]): "prompts"}.get(
                frozenset(kinds), "mixed"
            )
        )
        return execute(out)

    runner.run_slice, runner.execute = timed_slice, timed_execute
    return events


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_slices_with_decodes_between_match_transformers(tiny_checkpoint, arch):
    path = tiny_checkpoint(arch)
    _, expected = hf_reference(path, arch)
    options = dict(target_itl_ms=1e-3, max_num_batched_tokens=48, max_num_seqs=3)
    llm = LLM(str(path), **options, **SMALL_KV)
    core = llm.engine.core
    dear_prefill(core)
    events = record_events(core)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    num_layers = core.runner.num_local_layers
    assert num_layers >= 2 and core.step_stats.num_sliced >= 3
    # a slice of one layer each; a decode step before every slice but the first of a step
    runs = "".join("s" if e == "slice" else e[0] for e in events)
    assert "s" * num_layers not in runs and "mixed" not in events
    assert runs.count("s") == num_layers * core.step_stats.num_sliced
    assert core.stats().num_sliced_steps == core.step_stats.num_sliced  # (/metrics)
    assert ("sd" * (num_layers - 1)) in runs
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_a_prompt_aborted_in_slices_waits_for_its_last_slice(tiny_checkpoint):
    """Aborted between its slices, a prompt gets no token, the decodes beside it and the
    prompts after it finish, and every block is back in the pool."""
    config = EngineConfig(
        model=str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24, target_itl_ms=1e-3,
        max_num_batched_tokens=48,
    )  # fmt: skip
    core = EngineCore.from_config(config)
    try:
        dear_prefill(core)
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        core.add_request(EngineCoreRequest("short", PROMPTS[1], params, 12, [1]))
        while not core.step():  # its prefill, then it decodes
            pass
        core.add_request(EngineCoreRequest("long", PROMPTS[0], params, 12, [1]))
        core.add_request(EngineCoreRequest("after", PROMPTS[2], params, 12, [1]))
        core.step()  # a prompt's first chunk goes in slices, "short" decodes
        (victim,) = [s.request.request_id for s in core._in_flight[0].out.scheduled]
        core.abort_requests([victim])
        assert victim in core.scheduler.requests  # its slices are not done yet
        finished = set()
        while core.has_unfinished():
            outputs = core.step()
            assert victim not in {o.request_id for o in outputs}
            finished |= {o.request_id for o in outputs if o.finish_reason}
        assert finished == {"short", "long", "after"} - {victim}
        assert victim not in core.scheduler.requests
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    finally:
        core.close()


def test_no_block_is_registered_for_prefix_hits_before_it_is_written(tiny_checkpoint):
    """The decodes a step leaves out when its prompts go in slices had their slots given
    at scheduling, and where a decode's token fills its block, that block was registered
    for prefix hits then: such a step runs its decodes at once. So whenever decodes are
    left out, no running request outside the slices has a block registered past what it
    has computed (an abort or a preemption would free such a block, its KV unwritten)."""
    config = EngineConfig(
        model=str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24, target_itl_ms=1e-3,
        max_num_batched_tokens=48,
    )  # fmt: skip
    core = EngineCore.from_config(config)
    block_size = core.kv_cache.block_size
    left_out = []  # per sliced step: whether its decodes were left out

    def unwritten() -> list[str]:
        busy = core._busy()
        return [
            r.request_id
            for r in core.scheduler.running
            if r.request_id not in busy
            and core.kv_cache.num_hashed_blocks.get(r.request_id, 0)
            > r.num_computed_tokens // block_size
        ]

    slice_prompts = core._slice_prompts

    def checked(*args):
        now = slice_prompts(*args)
        if now is not None:
            left_out.append(now.empty)
            assert not now.empty or unwritten() == []
        return now

    core._slice_prompts = checked
    try:
        dear_prefill(core)
        params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS[1:3]):  # short ones: they decode
            core.add_request(EngineCoreRequest(f"d{i}", prompt, params, 40, [1]))
        core.step()
        for i in range(3):  # long prompts beside them, one after another
            core.add_request(EngineCoreRequest(f"p{i}", PROMPTS[0][i:], params, 4, [1]))
        while core.has_unfinished():
            core.step()
            assert unwritten() == []
        assert any(left_out) and not all(left_out)  # both cases came up
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    finally:
        core.close()


def test_slices_measured_well_within_the_target_run_back_to_back(tiny_checkpoint):
    """The first slice is predicted (from the dear cost model) past the target, so the
    decodes get their step first; the slices after it are predicted from what it took (a
    millisecond on the tiny model), and run back to back while the decodes' last tokens
    are younger than the 2 s target."""
    path = tiny_checkpoint("llama")
    _, expected = hf_reference(path, "llama")
    options = dict(target_itl_ms=2000, max_num_batched_tokens=48, max_num_seqs=3)
    llm = LLM(str(path), **options, **SMALL_KV)
    core = llm.engine.core
    dear_prefill(core)
    events = record_events(core)
    assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
    runs = "".join("s" if e == "slice" else e[0] for e in events)
    assert core.step_stats.num_sliced >= 2 and runs.count("dss") == core.step_stats.num_sliced


def test_request_fields_give_what_they_give_without_slices(tiny_checkpoint):
    """n > 1, seeded draws, penalties, logprobs and prompt logprobs, under slices with a
    decode step after each: the same tokens as without them, logprobs within 1e-4 (a
    decode row multiplied in a step of its own rather than beside a chunk goes through
    another matmul of the same fp32 products, summed in another order)."""
    path = str(tiny_checkpoint("llama"))
    params = [
        SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.0, logprobs=3, prompt_logprobs=2, max_tokens=20),
        SamplingParams(temperature=1.0, top_k=5, seed=3, presence_penalty=0.5,
                       repetition_penalty=1.2, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.0, min_tokens=6, max_tokens=30, ignore_eos=True),
    ]  # fmt: skip
    runs = []
    for target in (0.0, 1e-3):
        llm = LLM(path, target_itl_ms=target, max_num_batched_tokens=48, **SMALL_KV)
        dear_prefill(llm.engine.core)
        outputs = llm.generate(PROMPTS, params)
        sliced = llm.engine.core.step_stats.num_sliced
        runs.append((outputs, sliced))
    (plain, none), (sliced_outputs, sliced) = runs
    assert none == 0 and sliced >= 2

    def same(a, b) -> bool:  # {token: logprob}, or None
        if a is None or b is None:
            return a is b
        return a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)

    def close(x, y) -> bool:  # a position's entries each, or None
        if x is None or y is None:
            return x is y
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))

    assert plain[1].prompt_logprobs is not None  # (the request that asks for them)
    for a, b in zip(plain, sliced_outputs, strict=True):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
        pairs = zip(a.outputs, b.outputs, strict=True)
        assert all(close(x.logprobs, y.logprobs) for x, y in pairs)
        assert close(a.prompt_logprobs, b.prompt_logprobs)


def test_a_step_within_the_target_runs_whole(tiny_checkpoint):
    """Where the step with its decodes is predicted within the target, nothing is sliced
    (the tiny model's own costs: milliseconds)."""
    llm = LLM(str(tiny_checkpoint("llama")), target_itl_ms=10_000, max_num_batched_tokens=48,
              **SMALL_KV)  # fmt: skip
    events = record_events(llm.engine.core)
    llm.generate(PROMPTS, GREEDY)
    assert llm.engine.core.step_stats.num_sliced == 0 and "slice" not in events
    assert "mixed" in events


def test_a_decodes_only_step_takes_no_prompt_token():
    """Between a prompt's slices the scheduler gives the running decodes a step and
    nothing else: no chunk of a running prompt (in flight or not), no waiting prompt."""
    scheduler = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(scheduler)
    scheduler.add(make_request("a", tokens(0, 5), max_tokens=8))
    scheduler.add(make_request("b", tokens(100, 5), max_tokens=8))
    runner.step()  # both prompts: a and b decode from here
    scheduler.add(make_request("long", tokens(200, 100), max_tokens=2))
    scheduler.add(make_request("other", tokens(400, 60), max_tokens=2))
    out = scheduler.schedule()
    assert scheduled_tokens(out) == {"a": 1, "b": 1, "long": 30}
    busy = {"long": 30}  # its chunk in flight; "other" waits, "long" has chunks left
    decodes = scheduler.schedule(busy=busy, decodes_only=True)
    assert scheduled_tokens(decodes) == {"a": 1, "b": 1}
    assert [r.request_id for r in scheduler.waiting] == ["other"]


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_target_itl_ms_is_checked(bad):
    with pytest.raises(ValueError, match="target_itl_ms must be >= 0"):
        EngineConfig(model="x", target_itl_ms=bad)


def test_the_target_flag_takes_auto_or_milliseconds():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    options = [engine_options(parser.parse_args(argv)) for argv in ([], ["--target-itl-ms", "0"],
               ["--target-itl-ms", "auto"], ["--target-itl-ms", "95.5"])]  # fmt: skip
    assert [o["target_itl_ms"] for o in options] == [None, 0.0, None, 95.5]
    assert EngineConfig(model="x").target_itl_ms is None  # auto, by default
    with pytest.raises(SystemExit):
        parser.parse_args(["--target-itl-ms", "fast"])


# a 512-token prompt predicted at 2 + 512 * 0.5 + 131.072 * 0.25 = 290.768 ms
PRICED = StepCoefficients(base=2.0, per_prefill_token=0.5, per_decode_row=1.0, per_attention=0.25)


def test_the_auto_target_is_a_share_of_a_512_token_prompt(tiny_checkpoint):
    """auto follows the cost model: 0.85 of what it predicts a 512-token prompt alone
    takes, as it learns; an explicit target stays as given."""
    for target, expected in ((None, 0.85 * 290.768), (0.0, 0.0), (80.0, 80.0)):
        config = EngineConfig(model=str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24,
                              target_itl_ms=target)  # fmt: skip
        core = EngineCore.from_config(config)
        try:
            use_cost_model(core, PRICED)
            assert core.target_itl_ms == pytest.approx(expected)
            slower = StepCoefficients(base=2.0, per_prefill_token=1.0, per_attention=0.25)
            use_cost_model(core, slower)
            assert (core.target_itl_ms > expected) == (target is None)
        finally:
            core.close()


def test_the_auto_target_slices_where_prompts_are_cheap_beside_dear_decodes(tiny_checkpoint):
    """With prefill predicted nearly free and decode rows at 100 ms, the auto target is a
    fraction of a millisecond and every mixed step beside decodes goes in slices (the
    tokens transformers' greedy ones); with prefill dear (a 512-token prompt at seconds)
    it is past any step and nothing is sliced."""
    path = tiny_checkpoint("llama")
    _, expected = hf_reference(path, "llama")
    cheap = StepCoefficients(base=0.0, per_prefill_token=1e-4, per_decode_row=100.0)
    for coefficients, sliced in ((cheap, True), (DEAR, False)):
        llm = LLM(str(path), max_num_batched_tokens=48, max_prefill_step_tokens=48,
                  max_num_seqs=3, **SMALL_KV)  # fmt: skip
        core = llm.engine.core
        use_cost_model(core, coefficients)
        events = record_events(core)
        assert token_ids(llm.generate(PROMPTS, GREEDY)) == expected
        assert (core.step_stats.num_sliced > 0) == sliced, events
        assert ("slice" in events) == sliced
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks

"""Requests that come together share a step: with no decodes running, prompts that can
finish their prefill go past `max_num_batched_tokens` (up to `max_prefill_step_tokens`),
later prompts finding the first one's blocks computed in that same step; and an idle core
waits (`batch_wait_ms`) for the requests the frontend is still preparing."""

from __future__ import annotations

import asyncio

import pytest
from test_scheduler import FakeRunner, make_request, make_scheduler, scheduled_tokens, tokens

from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.engine.async_llm import AsyncLLM
from ember.engine.step_cost import StepCoefficients, StepCostModel

PREFIX = tokens(100, 48)  # three blocks of 16


def test_with_no_decodes_prompts_that_finish_go_past_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_step_tokens=128)
    for name, n in (("a", 40), ("b", 50)):
        scheduler.add(make_request(name, tokens(1000 * len(name) + n, n)))
    out, _ = FakeRunner(scheduler).step()
    assert scheduled_tokens(out) == {"a": 40, "b": 50}
    assert all(s.samples for s in out.scheduled)


def test_a_prompt_that_would_not_finish_keeps_to_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_step_tokens=64)
    scheduler.add(make_request("long", tokens(0, 100)))
    scheduler.add(make_request("short", tokens(500, 20)))  # after it, in arrival order
    runner = FakeRunner(scheduler)
    # the long one takes the budget; the short one finishes with the extra
    assert scheduled_tokens(runner.step()[0]) == {"long": 32, "short": 20}
    assert scheduled_tokens(runner.step()[0]) == {"long": 31, "short": 1}  # it decodes now
    runner.run_to_completion()


def test_running_decodes_keep_the_step_within_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_step_tokens=128)
    runner = FakeRunner(scheduler)
    scheduler.add(make_request("d", tokens(0, 10), max_tokens=50))
    runner.step()  # "d" decodes from here on
    scheduler.add(make_request("p", tokens(200, 40)))
    assert scheduled_tokens(runner.step()[0]) == {"d": 1, "p": 31}


def test_the_step_past_the_budget_keeps_within_the_step_time_budget():
    """1 ms a step, 1 ms a prompt token, attention free: with max_step_ms 100 the extra
    takes prompts while the step stays within 100 ms (two of 40 tokens: 81 ms; a third
    would make it 121); the one left over runs in the next step."""
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_step_tokens=256)
    scheduler.cost_model = StepCostModel(StepCoefficients(1.0, 1.0, 1.0, 0.0))
    scheduler.max_step_ms = 100.0
    for name in "abc":
        scheduler.add(make_request(name, tokens(1000 * ord(name), 40)))
    runner = FakeRunner(scheduler)
    assert scheduled_tokens(runner.step()[0]) == {"a": 40, "b": 40}
    runner.run_to_completion()


def test_off_at_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_step_tokens=32)
    scheduler.add(make_request("a", tokens(0, 40)))
    assert scheduled_tokens(FakeRunner(scheduler).step()[0]) == {"a": 32}


def test_a_burst_sharing_a_prefix_is_one_step_reading_the_first_ones_blocks():
    """Four sessions' first turns at once: the first computes the shared prefix, the other
    three find its blocks (cached as it is scheduled) and compute only their tails, in the
    same step; the fake runner checks every position each reads holds its own prefix."""
    scheduler = make_scheduler(max_num_batched_tokens=32, max_prefill_step_tokens=256)
    for i in range(4):
        scheduler.add(make_request(f"s{i}", PREFIX + tokens(1000 + 100 * i, 8)))
    runner = FakeRunner(scheduler)
    out, _ = runner.step()
    assert scheduled_tokens(out) == {"s0": 56, "s1": 8, "s2": 8, "s3": 8}
    assert all(s.samples for s in out.scheduled)
    assert [r.num_cached_tokens for r in scheduler.running] == [0, 48, 48, 48]
    runner.run_to_completion()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks


def test_a_prompt_whose_rest_does_not_fit_the_free_blocks_takes_a_chunk():
    """A prompt the extra would finish, but whose blocks are not free, takes a chunk of
    the budget as it would without the extra (preempting nothing for a longer step); the
    extra it gave back finishes the next one."""
    scheduler = make_scheduler(num_blocks=8, max_num_batched_tokens=32, max_prefill_step_tokens=256)
    scheduler.add(make_request("big", tokens(0, 150)))  # 10 blocks: more than there are
    scheduler.add(make_request("small", tokens(500, 40)))
    out, _ = FakeRunner(scheduler).step()
    assert scheduled_tokens(out) == {"big": 32, "small": 40}


def test_a_running_prompt_whose_rest_does_not_fit_preempts_nothing():
    scheduler = make_scheduler(num_blocks=9, max_num_batched_tokens=32, max_prefill_step_tokens=256)
    scheduler.add(make_request("a", tokens(0, 150)))  # 10 blocks in all: one more than free
    runner = FakeRunner(scheduler)
    assert scheduled_tokens(runner.step()[0]) == {"a": 32}
    out, _ = runner.step()  # its rest would finish with the extra, but has no blocks
    assert scheduled_tokens(out) == {"a": 32} and out.preempted == []


@pytest.mark.parametrize("attention_backend", ["cpu-paged", "sdpa"])
def test_a_burst_in_one_step_gives_each_prompt_its_own_greedy_output(
    tiny_checkpoint, attention_backend
):
    """The engine, end to end: four prompts sharing a 200-token prefix at once, with 64-token
    chunks, take one prefill step (the later three reading the first one's KV computed in
    it) and give the tokens each gives alone, uncached."""
    path = str(tiny_checkpoint("llama"))
    prefix = [(17 * i) % 500 + 3 for i in range(200)]
    prompts = [prefix + [5 + i, 6, 7 + 2 * i] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    options = dict(kv_cache_memory=1 << 24, attention_backend=attention_backend)
    alone = LLM(path, enable_prefix_caching=False, **options)
    expected = [alone.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]

    llm = LLM(  # no step budget: the cost model's prior would keep the step to 64 tokens
        path, max_num_batched_tokens=64, max_prefill_step_tokens=1024, max_step_ms=0, **options
    )
    outs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.num_cached_tokens for o in outs] == [0, 192, 192, 192]
    assert llm.engine.core.step_stats.num_steps == 8  # one prefill step, 7 decode steps
    assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks


def test_max_prefill_step_tokens_is_checked():
    with pytest.raises(ValueError, match="max_prefill_step_tokens"):
        EngineConfig(max_prefill_step_tokens=0)
    with pytest.raises(ValueError, match="batch_wait_ms"):
        EngineConfig(batch_wait_ms=-1)
    assert EngineConfig(max_num_batched_tokens=4096).max_step_tokens == 4096


# -------------------------------------------------------------- the core waits for a batch

PROMPT = [(5 * i) % 400 + 7 for i in range(40)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


async def _prepare_and_run(engine: AsyncLLM, delay: float, fail: bool = False):
    """One request as the server serves one: prepared (`delay` seconds of "tokenizing"),
    then sent; `fail`: its checks fail, so it is never sent."""
    with engine.preparing():
        await asyncio.sleep(delay)
        if fail:
            return None
        return [out async for out in engine.generate(PROMPT, GREEDY)]


def _run_burst(engine: AsyncLLM, delays: list[float], fail: list[bool] | None = None):
    async def main():
        fails = fail or [False] * len(delays)
        return await asyncio.gather(
            *(_prepare_and_run(engine, d, f) for d, f in zip(delays, fails, strict=True))
        )

    return asyncio.run(main())


@pytest.mark.parametrize("batch_wait_ms", [1000.0, 0.0])
def test_an_idle_core_waits_for_the_requests_being_prepared(tiny_checkpoint, batch_wait_ms):
    """The first request is sent at once, two more after 0.2 s of preparing: the core
    waits for them and runs the three prompts in one step (6 steps for 6 tokens each), or,
    with batch_wait_ms 0, starts the first alone."""
    engine = AsyncLLM(
        str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24, batch_wait_ms=batch_wait_ms
    )
    try:
        streams = _run_burst(engine, [0.0, 0.2, 0.2])
        assert all(s[-1].finished for s in streams)
        assert engine.num_preparing == 0
        num_steps = engine.stats().num_steps
        assert num_steps == 6 if batch_wait_ms else num_steps > 6
    finally:
        engine.shutdown()


def test_a_request_that_fails_its_checks_is_not_waited_for(tiny_checkpoint):
    """The first request says one more is on its way; that one fails (never sent), and the
    frontend says so, so the core runs the first without waiting out its 1 s."""
    engine = AsyncLLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24, batch_wait_ms=1000)
    try:
        loop_time = []

        async def main():
            start = asyncio.get_running_loop().time()
            first = asyncio.ensure_future(_prepare_and_run(engine, 0.0))
            await asyncio.gather(_prepare_and_run(engine, 0.05, fail=True), first)
            loop_time.append(asyncio.get_running_loop().time() - start)
            return first.result()

        stream = asyncio.run(main())
        assert stream[-1].finished and engine.num_preparing == 0
        assert loop_time[0] < 0.6  # not the 1 s wait
    finally:
        engine.shutdown()

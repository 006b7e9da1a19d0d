"""Scheduling policy "shortest": the prompts still to compute go by response ratio, so a
short prompt is not held up behind a long one that came a moment earlier, and no prompt
waits for ever (driven with the scheduler tests' fake runner, whose random workloads run
under both policies; the real engine at the end)."""

from __future__ import annotations

import pytest
from test_scheduler import FakeRunner, scheduled_tokens, tokens

from ember.config import EngineConfig
from ember.engine import scheduler as scheduler_module
from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request
from ember.engine.scheduler import Scheduler
from ember.sampling_params import SamplingParams


class Clock:
    """time.monotonic for the scheduler: moves only when told."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(scheduler_module.time, "monotonic", clock)
    return clock


def scheduler_with(policy: str, num_blocks: int = 256, budget: int = 64, **kwargs) -> Scheduler:
    kv = KVCacheManager(num_blocks, 16, kwargs.pop("enable_prefix_caching", True))
    return Scheduler(kv, budget, 16, 4096, policy=policy, **kwargs)


def request(request_id: str, prompt: list[int], clock: Clock, max_tokens: int = 2) -> Request:
    return Request(request_id, prompt, SamplingParams(), max_tokens, arrival_time=clock.now)


def first_token_steps(runner: FakeRunner) -> dict[str, int]:
    """The step at which each request's prompt was done (its first token sampled)."""
    done: dict[str, int] = {}
    for i, out in enumerate(runner.outputs):
        for sched in out.scheduled:
            if sched.samples:
                done.setdefault(sched.request.request_id, i)
    return done


def run_long_then_short(policy: str, clock: Clock) -> FakeRunner:
    """A 640-token prompt starts alone; a 40-token one arrives after its first chunk."""
    scheduler = scheduler_with(policy)
    runner = FakeRunner(scheduler)
    scheduler.add(request("long", tokens(0, 640), clock))
    runner.step()
    clock.now += 0.05
    scheduler.add(request("short", tokens(5000, 40), clock))
    for _ in range(100):
        if not scheduler.num_unfinished:
            break
        clock.now += 0.05
        runner.step()
    assert not scheduler.num_unfinished
    return runner


def test_a_short_prompt_goes_before_the_rest_of_a_long_one(clock):
    runner = run_long_then_short("shortest", clock)
    assert scheduled_tokens(runner.outputs[1]) == {"short": 40, "long": 24}
    done = first_token_steps(runner)
    assert done["short"] == 1 and done["long"] == 10  # the long one loses one step's worth


def test_fcfs_finishes_the_long_prompt_first(clock):
    runner = run_long_then_short("fcfs", clock)
    assert scheduled_tokens(runner.outputs[1]) == {"long": 64}
    done = first_token_steps(runner)
    assert done["long"] == 9 and done["short"] == 10


def test_a_long_prompt_is_not_starved_by_a_stream_of_short_ones(clock):
    """Two 30-token prompts arrive before every step, filling the 64-token budget: they go
    first, but the long one's ratio grows with its wait until it wins."""
    scheduler = scheduler_with("shortest", num_blocks=4096)
    runner = FakeRunner(scheduler)
    scheduler.add(request("long", tokens(0, 300), clock))
    for i in range(200):
        for j in range(2):
            scheduler.add(request(f"s{i}-{j}", tokens(10_000 + 100 * (2 * i + j), 30), clock))
        clock.now += 0.1
        runner.step()
        if "long" in first_token_steps(runner):
            break
    done = first_token_steps(runner)
    assert "long" in done, "the long prompt starved"
    assert 10 < done["long"] < 30
    assert scheduled_tokens(runner.outputs[0]) == {"s0-0": 30, "s0-1": 30, "long": 4}


def test_a_prompt_mostly_in_the_prefix_cache_counts_as_short(clock):
    scheduler = scheduler_with("shortest", budget=64)
    runner = FakeRunner(scheduler)
    context = tokens(0, 320)
    scheduler.add(request("turn1", context, clock, max_tokens=1))
    while scheduler.num_unfinished:
        clock.now += 0.05
        runner.step()
    # the next turn resends the whole context (320 cached) plus 16 tokens; a 100-token
    # prompt arrived first
    scheduler.add(request("other", tokens(9000, 100), clock))
    clock.now += 0.01
    scheduler.add(request("turn2", context + tokens(400, 16), clock))
    clock.now += 0.01
    out, _ = runner.step()
    assert list(scheduled_tokens(out)) == ["turn2", "other"]
    assert scheduled_tokens(out)["turn2"] == 16  # the 320 cached tokens not recomputed


def test_decodes_are_scheduled_first_under_either_policy(clock):
    scheduler = scheduler_with("shortest", budget=32)
    runner = FakeRunner(scheduler)
    scheduler.add(request("a", tokens(0, 10), clock, max_tokens=10))
    scheduler.add(request("b", tokens(100, 12), clock, max_tokens=10))
    runner.step()
    clock.now += 0.5
    scheduler.add(request("c", tokens(200, 100), clock))
    out, _ = runner.step()
    assert scheduled_tokens(out) == {"a": 1, "b": 1, "c": 30}


def test_an_unknown_policy_is_refused_naming_it():
    with pytest.raises(ValueError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="scheduling policy"):
        scheduler_with("lifo")


def test_the_engine_gives_each_prompt_the_same_tokens_under_either_policy(tiny_checkpoint):
    from ember import LLM

    prompts = [list(range(3, 3 + n)) for n in (150, 12, 90, 7, 40)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = {}
    for policy in ("fcfs", "shortest"):
        llm = LLM(
            str(tiny_checkpoint("llama")),
            scheduling_policy=policy,
            max_num_batched_tokens=64,
            kv_cache_memory=1 << 24,
            matmul_precision="ieee",
        )
        outputs[policy] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.core.scheduler.policy == policy
        assert llm.engine.core.kv_cache.num_free_blocks == llm.engine.core.kv_cache.num_blocks
    assert outputs["fcfs"] == outputs["shortest"]

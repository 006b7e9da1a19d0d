"""The scheduler driven step by step with a fake model runner (no model).

`FakeRunner` plays the model: for every scheduled request it writes each computed token's
"KV" (the token prefix it depends on, plus the cache salt) into the slot the block table
gives, checks that every position the request attends to holds the KV of its own prefix
(so a wrong prefix hit, a block shared by mistake or reused too early is caught), and
samples a token for the requests whose step reaches the end of their known tokens.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ember.engine.kv_cache import KVCacheManager
from ember.engine.request import Request, RequestStatus
from ember.engine.scheduler import Scheduler, SchedulerOutput
from ember.sampling_params import SamplingParams

EOS = 2


def make_request(
    request_id: str,
    prompt_token_ids: list[int],
    max_tokens: int = 4,
    *,
    eos_token_ids: frozenset[int] = frozenset(),
    cache_salt: str | None = None,
    wait_for: Request | None = None,
    **params,
) -> Request:
    return Request(
        request_id,
        list(prompt_token_ids),
        SamplingParams(**params),
        max_tokens,
        eos_token_ids=eos_token_ids,
        cache_salt=cache_salt,
        wait_for=wait_for,
    )


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 16,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    policy: str = "fcfs",
    max_prefill_step_tokens: int = 0,
) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
    return Scheduler(
        kv, max_num_batched_tokens, max_num_seqs, max_model_len, policy=policy,
        max_prefill_step_tokens=max_prefill_step_tokens,
    )  # fmt: skip


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def counting_sampler(request: Request) -> int:
    """The i-th output token is 1000 + i, so lost or repeated outputs show."""
    return 1000 + request.num_output_tokens


class FakeRunner:
    def __init__(self, scheduler: Scheduler, sample: Callable[[Request], int] = counting_sampler):
        self.scheduler = scheduler
        self.sample = sample
        self.block_size = scheduler.kv_cache.block_size
        self.kv: dict[tuple[int, int], tuple] = {}  # (block_id, slot) -> what was computed there
        self.outputs: list[SchedulerOutput] = []

    def kv_value(self, request: Request, pos: int) -> tuple:
        return (request.cache_salt or "", tuple(request.token_ids[: pos + 1]))

    def step(self) -> tuple[SchedulerOutput, list[Request]]:
        out = self.scheduler.schedule()
        return out, self.execute(out)

    def execute(self, out: SchedulerOutput) -> list[Request]:
        """Runs one scheduled step, samples, and applies it; returns the finished requests."""
        scheduler = self.scheduler
        if out.num_scheduled_tokens > scheduler.max_num_batched_tokens:
            # past the budget only with no decodes, for prompts that finish in the step
            # (but for the one chunk the budget itself ends in)
            assert out.num_scheduled_tokens <= scheduler.max_prefill_step_tokens
            assert sum(not s.samples for s in out.scheduled) <= 1
        assert len({id(s.request) for s in out.scheduled}) == len(out.scheduled)
        assert len(scheduler.running) <= scheduler.max_num_seqs
        for sched in out.scheduled:
            request, start = sched.request, sched.request.num_computed_tokens
            end = start + sched.num_new_tokens
            assert sched.num_new_tokens >= 1 and end <= request.num_tokens
            assert len(sched.block_ids) >= -(-end // self.block_size)
            for pos in range(start, end):
                slot = (sched.block_ids[pos // self.block_size], pos % self.block_size)
                self.kv[slot] = self.kv_value(request, pos)
        for sched in out.scheduled:  # attention reads every position up to the step's end
            request = sched.request
            for pos in range(request.num_computed_tokens + sched.num_new_tokens):
                slot = (sched.block_ids[pos // self.block_size], pos % self.block_size)
                assert self.kv.get(slot) == self.kv_value(request, pos), (
                    f"{request.request_id} reads wrong KV at position {pos}"
                )
        sampled = {
            s.request.request_id: [self.sample(s.request)] for s in out.scheduled if s.samples
        }
        _, finished = scheduler.update(out, sampled)
        for request in finished:
            assert (
                request.status.finished and scheduler.kv_cache.block_ids(request.request_id) == []
            )
        assert scheduler.kv_cache.check_integrity()
        self.outputs.append(out)
        return finished

    def run_to_completion(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.scheduler.num_unfinished:
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")


def scheduled_tokens(out: SchedulerOutput) -> dict[str, int]:
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


# ---------------------------------------------------------------- budget and chunked prefill


def test_100_token_prompt_with_budget_32_prefills_in_4_chunks_and_samples_on_the_last():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    request = make_request("a", tokens(0, 100), max_tokens=3)
    scheduler.add(request)
    runner = FakeRunner(scheduler)
    for num_new, samples in [(32, False), (32, False), (32, False), (4, True)]:
        out = scheduler.schedule()
        assert [(s.num_new_tokens, s.samples) for s in out.scheduled] == [(num_new, samples)]
        runner.execute(out)
    assert request.num_computed_tokens == 100 and request.output_token_ids == [1000]
    runner.run_to_completion()
    assert [scheduled_tokens(out) for out in runner.outputs[4:]] == [{"a": 1}, {"a": 1}]
    assert request.output_token_ids == [1000, 1001, 1002]


def test_decodes_and_a_prefill_chunk_share_a_step_within_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    runner = FakeRunner(scheduler)
    scheduler.add(make_request("a", tokens(0, 10), max_tokens=10))
    scheduler.add(make_request("b", tokens(100, 12), max_tokens=10))
    runner.step()
    scheduler.add(make_request("c", tokens(200, 100), max_tokens=2))
    out, _ = runner.step()
    assert scheduled_tokens(out) == {"a": 1, "b": 1, "c": 30}  # decodes first, chunk fills
    assert [s.samples for s in out.scheduled] == [True, True, False]
    out, _ = runner.step()
    assert scheduled_tokens(out) == {"a": 1, "b": 1, "c": 30}
    runner.run_to_completion()
    assert all(out.num_scheduled_tokens <= 32 for out in runner.outputs)


def test_token_budget_is_respected_and_used_every_step():
    scheduler = make_scheduler(max_num_batched_tokens=24)
    runner = FakeRunner(scheduler)
    requests = [make_request(str(i), tokens(50 * i, 5 + 9 * i), max_tokens=6) for i in range(6)]
    for request in requests:
        scheduler.add(request)
    runner.run_to_completion()
    pending_prompt = sum(r.num_prompt_tokens for r in requests)
    for out in runner.outputs:
        assert out.num_scheduled_tokens <= 24
        if pending_prompt >= 24:
            assert out.num_scheduled_tokens == 24  # never idle while prompt tokens wait
        pending_prompt -= sum(
            min(s.num_new_tokens, s.request.num_prompt_tokens) for s in out.scheduled
        )
    assert all(r.output_token_ids == tokens(1000, 6) for r in requests)


# ---------------------------------------------------------------- admission


def test_max_num_seqs_caps_the_running_batch():
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(scheduler)
    requests = [make_request(str(i), tokens(10 * i, 4), max_tokens=3) for i in range(5)]
    for request in requests:
        scheduler.add(request)
    out, _ = runner.step()
    assert list(scheduled_tokens(out)) == ["0", "1"]
    runner.run_to_completion()
    assert all(len(out.scheduled) <= 2 for out in runner.outputs)
    first_step = {}
    for i, out in enumerate(runner.outputs):
        for rid in scheduled_tokens(out):
            first_step.setdefault(rid, i)
    assert first_step == {"0": 0, "1": 0, "2": 3, "3": 3, "4": 6}
    assert all(r.output_token_ids == tokens(1000, 3) for r in requests)


def test_waiting_requests_are_admitted_first_come_first_served():
    scheduler = make_scheduler(max_num_batched_tokens=10)
    runner = FakeRunner(scheduler)
    for i in range(4):
        scheduler.add(make_request(str(i), tokens(10 * i, 6), max_tokens=2))
    outs = [runner.step()[0] for _ in range(3)]
    assert scheduled_tokens(outs[0]) == {"0": 6, "1": 4}
    assert scheduled_tokens(outs[1]) == {"0": 1, "1": 2, "2": 6, "3": 1}
    assert list(scheduled_tokens(outs[2])) == ["1", "2", "3"]  # "0" finished


def test_a_short_request_does_not_overtake_one_that_waits_for_blocks():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    scheduler.add(make_request("big_running", tokens(0, 8), max_tokens=2))  # 2 (then 3) blocks
    runner.step()
    scheduler.add(make_request("big_waiting", tokens(100, 8), max_tokens=2))
    scheduler.add(make_request("small", [300], max_tokens=2))
    out, _ = runner.step()
    assert scheduled_tokens(out) == {"big_running": 1}  # 1 block left: small would fit
    assert [r.request_id for r in scheduler.waiting] == ["big_waiting", "small"]
    runner.run_to_completion()
    admitted = [rid for out in runner.outputs for rid in scheduled_tokens(out)]
    assert admitted.index("big_waiting") < admitted.index("small")


def test_prefix_hit_skips_cached_tokens_and_reports_them():
    scheduler = make_scheduler(max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    first = make_request("first", tokens(0, 40) + [7, 7])
    scheduler.add(first)
    runner.step()
    second = make_request("second", tokens(0, 40) + [8])
    scheduler.add(second)
    out, _ = runner.step()
    assert scheduled_tokens(out) == {"first": 1, "second": 41 - 32}
    assert second.num_cached_tokens == 32 and first.num_cached_tokens == 0
    runner.run_to_completion()
    assert second.output_token_ids == tokens(1000, 4)


def test_prefix_cache_stats_count_each_prompt_once_while_it_waits_for_blocks():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    scheduler.add(make_request("a", tokens(0, 8), max_tokens=5))
    runner.step()
    scheduler.add(make_request("b", tokens(100, 8), max_tokens=1))
    runner.run_to_completion()
    assert [r for out in runner.outputs for r in scheduled_tokens(out)].count("b") == 1
    assert len(runner.outputs) > 3  # b waited several steps for a's blocks
    assert scheduler.kv_cache.stats.queries == 8 + 8


# ---------------------------------------------------------------- preemption


def test_preemption_takes_the_most_recent_request_and_requeues_it_first():
    # 6 blocks of 4 tokens: three 8-token prompts fill them; the first decode needs a 7th.
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    a, b, c = (make_request(n, tokens(100 * i, 8), max_tokens=6) for i, n in enumerate("abc"))
    for request in (a, b, c):
        scheduler.add(request)
    runner.step()
    assert scheduler.kv_cache.num_free_blocks == 0
    late = make_request("late", [5], max_tokens=6)
    scheduler.add(late)
    out, _ = runner.step()
    assert out.preempted == [c]
    assert scheduled_tokens(out) == {"a": 1, "b": 1}  # and nobody admitted this step
    assert list(scheduler.waiting) == [c, late]
    assert c.status == RequestStatus.WAITING and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and c.output_token_ids == [1000]  # output is kept
    assert scheduler.kv_cache.block_ids("c") == []
    runner.run_to_completion()
    admitted = [rid for out in runner.outputs[2:] for rid in scheduled_tokens(out)]
    assert admitted.index("c") < admitted.index("late")
    for request in (a, b, c, late):
        assert request.output_token_ids == tokens(1000, 6)
        assert request.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.kv_cache.num_free_blocks == 6


def test_two_requests_short_of_blocks_preempt_the_two_newest():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    a, b, c, d = (make_request(n, tokens(100 * i, 4)) for i, n in enumerate("abcd"))
    for request in (a, b, c, d):
        scheduler.add(request)
    runner.step()  # one full block each; every next token needs a new block
    out, _ = runner.step()
    assert out.preempted == [d, c]
    assert list(scheduler.waiting) == [c, d]
    assert scheduled_tokens(out) == {"a": 1, "b": 1}
    runner.run_to_completion()
    assert all(r.output_token_ids == tokens(1000, 4) for r in (a, b, c, d))


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_every_request_finishes_despite_heavy_preemption(enable_prefix_caching):
    scheduler = make_scheduler(
        num_blocks=8,
        block_size=4,
        max_num_batched_tokens=16,
        max_model_len=32,
        enable_prefix_caching=enable_prefix_caching,
    )
    runner = FakeRunner(scheduler)
    requests = [
        make_request(str(i), tokens(0, 6) + tokens(100 * i, 4 + 2 * i), max_tokens=10)
        for i in range(6)
    ]
    for request in requests:
        scheduler.add(request)
    runner.run_to_completion(max_steps=500)
    assert sum(r.num_preemptions for r in requests) > 0
    for request in requests:
        assert request.output_token_ids == tokens(1000, 10)
        assert request.status == RequestStatus.FINISHED_LENGTH
    assert scheduler.kv_cache.num_free_blocks == 8
    assert not scheduler.waiting and not scheduler.running


def test_preempted_request_gets_its_surviving_cached_blocks_back():
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    a = make_request("a", tokens(0, 8), max_tokens=2)
    b = make_request("b", tokens(100, 7), max_tokens=2)  # room left in its last block
    c = make_request("c", tokens(200, 8), max_tokens=2)
    for request in (a, b, c):
        scheduler.add(request)
    runner.step()
    out, _ = runner.step()
    assert out.preempted == [c]  # a took c's last block; c's first block stays cached
    out, _ = runner.step()
    assert scheduled_tokens(out) == {"c": 9 - 4}
    runner.run_to_completion()
    assert c.output_token_ids == tokens(1000, 2) and c.num_cached_tokens == 0


# ---------------------------------------------------------------- abort


@pytest.mark.parametrize("when", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_at_any_moment_frees_every_block(when):
    scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8)
    runner = FakeRunner(scheduler)
    other = make_request("other", tokens(0, 8), max_tokens=8)
    victim = make_request("victim", tokens(100, 12), max_tokens=8)
    scheduler.add(other)
    scheduler.add(victim)
    steps = {"waiting": 0, "prefilling": 2, "decoding": 3, "preempted": 5}[when]
    for _ in range(steps):
        runner.step()
    expected_status = RequestStatus.WAITING if when in ("waiting", "preempted") else None
    if expected_status is not None:
        assert victim.status == expected_status
        assert victim.num_preemptions == (when == "preempted")
    else:
        assert victim.status == RequestStatus.RUNNING
        assert (victim.num_computed_tokens < 12) == (when == "prefilling")
    other_blocks = len(scheduler.kv_cache.block_ids("other"))
    assert scheduler.abort("victim") is victim
    assert victim.status == RequestStatus.FINISHED_ABORTED
    assert scheduler.kv_cache.num_free_blocks == 6 - other_blocks
    assert victim not in scheduler.waiting and victim not in scheduler.running
    assert scheduler.num_unfinished == 1 and scheduler.kv_cache.check_integrity()
    assert scheduler.abort("victim") is None
    runner.run_to_completion()
    assert all("victim" not in scheduled_tokens(out) for out in runner.outputs[steps:])
    assert other.output_token_ids == tokens(1000, 8)
    assert scheduler.kv_cache.num_free_blocks == 6


def test_abort_of_an_unknown_request_is_a_no_op():
    scheduler = make_scheduler()
    assert scheduler.abort("nobody") is None


def test_request_ids_must_be_unique():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", [1]))
    with pytest.raises(ValueError, match="already in use"):
        scheduler.add(make_request("a", [2]))


# ---------------------------------------------------------------- finishing


def run_one(request: Request, sample: Callable[[Request], int], **kwargs) -> Scheduler:
    scheduler = make_scheduler(**kwargs)
    scheduler.add(request)
    FakeRunner(scheduler, sample).run_to_completion()
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_blocks
    return scheduler


def eos_at(index: int) -> Callable[[Request], int]:
    return lambda r: EOS if r.num_output_tokens == index else 1000 + r.num_output_tokens


def test_max_tokens_finishes_with_length():
    request = make_request("a", tokens(10, 5), max_tokens=7, eos_token_ids=frozenset({EOS}))
    run_one(request, counting_sampler)
    assert request.output_token_ids == tokens(1000, 7)
    assert request.status.value == "length"


def test_eos_finishes_with_stop_and_keeps_the_eos_token():
    request = make_request("a", tokens(10, 5), max_tokens=7, eos_token_ids=frozenset({EOS}))
    run_one(request, eos_at(2))
    assert request.output_token_ids == [1000, 1001, EOS]
    assert request.status.value == "stop"


def test_ignore_eos_generates_through_eos():
    request = make_request(
        "a", tokens(10, 5), max_tokens=7, eos_token_ids=frozenset({EOS}), ignore_eos=True
    )
    run_one(request, eos_at(2))
    assert request.num_output_tokens == 7 and request.output_token_ids[2] == EOS
    assert request.status.value == "length"


def test_stop_token_ids_finish_with_stop():
    request = make_request("a", tokens(10, 5), max_tokens=7, stop_token_ids=[1001])
    run_one(request, counting_sampler)
    assert request.output_token_ids == [1000, 1001]
    assert request.status.value == "stop"


def test_max_model_len_finishes_with_length():
    request = make_request("a", tokens(10, 15), max_tokens=100)
    run_one(request, counting_sampler, max_model_len=20)
    assert request.num_tokens == 20 and request.output_token_ids == tokens(1000, 5)
    assert request.status.value == "length"


# ---------------------------------------------------------------- n > 1


def test_sibling_waits_for_the_first_prefill_then_shares_its_prompt_blocks():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(scheduler)
    prompt = tokens(0, 40)
    first = make_request("first", prompt, max_tokens=3)
    sibling = make_request("sibling", prompt, max_tokens=3, wait_for=first)
    other = make_request("other", tokens(500, 8), max_tokens=3)
    for request in (first, sibling, other):
        scheduler.add(request)
    outs = [runner.step()[0] for _ in range(4)]
    assert scheduled_tokens(outs[0]) == {"first": 16}
    assert scheduled_tokens(outs[1]) == {"first": 16}
    assert scheduled_tokens(outs[2]) == {"first": 8, "other": 8}  # other is not held up
    assert scheduled_tokens(outs[3]) == {"first": 1, "other": 1, "sibling": 8}
    assert sibling.num_cached_tokens == 32
    sibling_blocks = outs[3].scheduled[2].block_ids
    assert sibling_blocks[:2] == scheduler.kv_cache.block_ids("first")[:2]
    runner.run_to_completion()
    assert sibling.output_token_ids == tokens(1000, 3)


def test_sibling_of_an_aborted_request_is_admitted():
    scheduler = make_scheduler(max_num_batched_tokens=16)
    runner = FakeRunner(scheduler)
    first = make_request("first", tokens(0, 40))
    sibling = make_request("sibling", tokens(0, 40), wait_for=first)
    scheduler.add(first)
    scheduler.add(sibling)
    runner.step()
    scheduler.abort("first")
    runner.run_to_completion(max_steps=20)
    assert sibling.output_token_ids == tokens(1000, 4)


# ---------------------------------------------------------------- random workloads

SHARED_PREFIXES = ([1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3], [3, 3, 2, 2, 1, 1, 3, 3, 2, 2])


def hashed_sampler(request: Request) -> int:
    """Deterministic per (request, position); 0 is EOS for requests that have one."""
    return zlib.crc32(f"{request.request_id}:{request.num_tokens}".encode()) % 6


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    max_model_len = draw(st.integers(4, 28))
    config = dict(
        block_size=block_size,
        max_model_len=max_model_len,
        num_blocks=-(-max_model_len // block_size) + draw(st.integers(0, 2)),
        max_num_batched_tokens=draw(st.integers(1, 20)),
        max_num_seqs=draw(st.integers(1, 5)),
        enable_prefix_caching=draw(st.booleans()),
        max_prefill_step_tokens=draw(st.sampled_from([0, 0, 12, 40])),
    )
    add = st.tuples(
        st.just("add"),
        st.sampled_from([None, *range(len(SHARED_PREFIXES))]),
        st.integers(1, max_model_len - 1).flatmap(
            lambda n: st.lists(st.integers(0, 5), min_size=n, max_size=n)
        ),
        st.integers(1, 16),  # max_tokens
        st.sampled_from([None, "tenant"]),
        st.booleans(),  # has EOS
        st.booleans(),  # ignore_eos
    )
    step = st.tuples(st.just("step"))
    sibling = st.tuples(st.just("sibling"), st.integers(0, 100))
    abort = st.tuples(st.just("abort"), st.integers(0, 100))
    ops = st.one_of(add, add, step, step, step, sibling, abort)
    drain = st.sampled_from([True, True, False])  # else: abort what is left
    first_adds = draw(st.lists(add, min_size=2, max_size=6))
    return config, first_adds + draw(st.lists(ops, min_size=5, max_size=40)), draw(drain)


def check_step_rules(scheduler: Scheduler, out: SchedulerOutput, running_before, waiting_before):
    num_preempted = len(out.preempted)
    if out.num_scheduled_tokens > scheduler.max_num_batched_tokens:  # none was decoding
        assert all(r.num_tokens - r.num_computed_tokens > 1 for r in running_before)
    assert out.preempted == running_before[::-1][:num_preempted]  # newest first
    for request in out.preempted:
        assert request.num_computed_tokens == 0 and request.status == RequestStatus.WAITING
    assert list(scheduler.waiting)[:num_preempted] == out.preempted[::-1]
    admitted = [s.request for s in out.scheduled if s.request not in running_before]
    if num_preempted:
        assert not admitted
    if scheduler.policy != "fcfs":
        return  # "shortest" admits by response ratio (tests/test_scheduling_policy.py)
    # FCFS: admitted in queue order; only a sibling still waiting for its prompt is passed.
    positions = [waiting_before.index(r) for r in admitted]
    assert positions == sorted(positions)
    for request in waiting_before[: max(positions, default=0)]:
        if request not in admitted:
            assert request.wait_for is not None and not request.wait_for.prefill_done


def request_from_op(op, request_id: str, requests: list[Request], max_model_len: int):
    if op[0] == "sibling":  # n > 1: same prompt, waits for the first one's prefill
        first = requests[op[1] % len(requests)]
        return make_request(
            request_id,
            first.prompt_token_ids,
            first.max_tokens,
            cache_salt=first.cache_salt,
            wait_for=first,
        )
    _, prefix_id, tail, max_tokens, salt, has_eos, ignore_eos = op
    prompt = (list(SHARED_PREFIXES[prefix_id]) if prefix_id is not None else []) + tail
    return make_request(
        request_id,
        prompt[: max_model_len - 1],
        max_tokens,
        eos_token_ids=frozenset({0}) if has_eos else frozenset(),
        cache_salt=salt,
        ignore_eos=ignore_eos,
    )


@pytest.mark.parametrize("policy", ["fcfs", "shortest"])
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_the_cache_consistent_and_finish(policy, workload):
    config, ops, drain = workload
    scheduler = make_scheduler(**config, policy=policy)
    kv = scheduler.kv_cache
    runner = FakeRunner(scheduler, hashed_sampler)
    requests: list[Request] = []
    aborted: set[str] = set()

    def step():
        running_before, waiting_before = list(scheduler.running), list(scheduler.waiting)
        out = scheduler.schedule()
        check_step_rules(scheduler, out, running_before, waiting_before)
        runner.execute(out)

    for op in ops:
        if op[0] == "step":
            step()
        elif op[0] == "abort" and scheduler.requests:
            live = sorted(scheduler.requests)
            request_id = live[op[1] % len(live)]
            assert scheduler.abort(request_id).status == RequestStatus.FINISHED_ABORTED
            aborted.add(request_id)
            assert kv.check_integrity()
        elif op[0] == "add" or (op[0] == "sibling" and requests):
            request = request_from_op(op, f"r{len(requests)}", requests, config["max_model_len"])
            scheduler.add(request)
            requests.append(request)

    if drain:
        for _ in range(3000):
            if not scheduler.num_unfinished:
                break
            step()
        assert not scheduler.num_unfinished, "requests starved or deadlocked"
    for request_id in sorted(scheduler.requests):
        scheduler.abort(request_id)
        aborted.add(request_id)

    assert kv.num_free_blocks == kv.num_blocks and kv.check_integrity()
    assert not scheduler.waiting and not scheduler.running
    for request in requests:
        check_finished(request, aborted, config["max_model_len"])


def check_finished(request: Request, aborted: set[str], max_model_len: int) -> None:
    output = request.output_token_ids
    assert output == [
        zlib.crc32(f"{request.request_id}:{request.num_prompt_tokens + i}".encode()) % 6
        for i in range(len(output))
    ], "an output token was lost or repeated"
    assert len(output) <= request.max_tokens and request.num_tokens <= max_model_len
    stops = request.eos_token_ids and not request.sampling_params.ignore_eos
    if stops:
        assert 0 not in output[:-1]
    if request.request_id in aborted:
        assert request.status == RequestStatus.FINISHED_ABORTED
    elif request.status == RequestStatus.FINISHED_STOPPED:
        assert stops and output[-1] == 0
    else:
        assert request.status == RequestStatus.FINISHED_LENGTH
        assert len(output) == request.max_tokens or request.num_tokens == max_model_len


def test_shortest_first_does_not_stall_on_a_sibling_waiting_for_a_running_prompt():
    """Found by the random workloads above: under "shortest", a waiting n > 1 sibling
    ranked above the running prompts (its own first among them) made the scheduler put
    them after it, though it cannot start before that prompt's prefill ends; with the
    blocks all held, every step was then empty. It must drain, with no blocks leaked."""
    config = dict(block_size=2, max_model_len=22, num_blocks=12, max_num_batched_tokens=4)
    config.update(max_num_seqs=3, enable_prefix_caching=True, max_prefill_step_tokens=40)
    ops = [("add", None, [0], 1, None, False, False), ("add", None, [0], 1, None, False, False)]
    ops += [("add", 1, [0] * 9, 3, None, False, False), ("add", None, [0], 5, None, False, False)]
    ops += [("add", 0, [0], 1, None, False, False), ("abort", 0), ("step",), ("step",)]
    ops += [("add", None, [0], 2, None, False, False), ("sibling", 38)]
    scheduler = make_scheduler(**config, policy="shortest")
    runner = FakeRunner(scheduler, hashed_sampler)
    requests: list[Request] = []
    for op in ops:
        if op[0] == "step":
            runner.execute(scheduler.schedule())
        elif op[0] == "abort":
            scheduler.abort(sorted(scheduler.requests)[op[1] % len(scheduler.requests)])
        else:
            request = request_from_op(op, f"r{len(requests)}", requests, config["max_model_len"])
            scheduler.add(request)
            requests.append(request)
    for _ in range(200):
        if not scheduler.num_unfinished:
            break
        out = scheduler.schedule()
        assert not out.empty, "a step with requests unfinished and nothing scheduled"
        runner.execute(out)
    assert not scheduler.num_unfinished
    assert scheduler.kv_cache.num_free_blocks == 12 and scheduler.kv_cache.check_integrity()

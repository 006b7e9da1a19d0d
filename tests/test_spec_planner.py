"""The adaptive mode's plan by cost: which drafts pay for themselves at a batch size,
from measured step times and each request's acceptance (ember.engine.spec_planner)."""

from __future__ import annotations

import pytest
from test_speculative import SMALL, Echo, Oracle, _assert_same, _prompts, _run

from ember import SamplingParams
from ember.engine.request import Request
from ember.engine.spec_planner import PROBE_EVERY, PROBE_MAX, DecodeCosts, DraftPlanner
from ember.engine.speculative import Proposer, Speculator
from ember.engine.step_cost import StepCoefficients, StepCostModel, StepShape

# measured on a 2-core CPU, Qwen2.5-Coder-1.5B (Q4_K): decode steps of one sequence with
# 0-4 drafts, and of four with 0, 1, 2 and 4 drafts each, in ms by (sequences, rows)
QWEN_1_5B = {
    1: {1: 114.0, 2: 127.0, 3: 138.5, 4: 150.5, 5: 167.6},
    4: {4: 157.0, 8: 232.0, 12: 382.0, 20: 953.0},
}


def planner_with(costs: dict[int, dict[int, float]], prior=None) -> DraftPlanner:
    planner = DraftPlanner(StepCostModel(prior or StepCoefficients()))
    for seqs, by_rows in costs.items():
        for rows, ms in by_rows.items():
            planner.decode_costs.observe(seqs, rows, ms)
    return planner


def test_decode_costs_are_measured_interpolated_and_extended():
    fallback = StepCostModel(StepCoefficients(base=10, per_decode_row=3))
    costs = DecodeCosts(fallback, smoothing=0.5)
    assert costs.predict(2, 5) == 10 + 3 * 5  # nothing seen for 2 sequences: the model
    costs.observe(2, 2, 20.0)
    assert costs.predict(2, 2) == 20.0
    assert costs.predict(2, 6) == 20.0 + 3 * 4  # one point: the model's cost per row
    costs.observe(2, 6, 60.0)
    assert costs.predict(2, 4) == 40.0  # between two
    assert costs.predict(2, 8) == 80.0  # past the last: the slope of the last two
    costs.observe(2, 6, 40.0)  # measured again: halfway (smoothing 0.5)
    assert costs.predict(2, 6) == 50.0
    costs.observe(2, 6, float("nan"))
    assert costs.predict(2, 6) == 50.0
    assert costs.predict(1, 1) == 13.0  # other batch sizes are their own
    costs.observe(4, 4, 100.0)  # one point at 4 sequences: the cost of a row more is
    assert costs.predict(4, 8) == 100.0 + 4 * 7.5  # that measured at 2 (2 -> 6 rows: +30 ms)


def test_drafts_that_pay_at_batch_1_are_cut_at_batch_4():
    planner = planner_with(QWEN_1_5B)
    # each draft accepted with probability 0.56 (the 0.5B draft model's rate on prose):
    # 3 drafts at batch 1 (2.05 tokens in 150.5 ms, against 1 in 114)
    assert planner.plan(1, [4], [0.56]) == [3]
    # at 4 sequences 1 each: 8 rows cost 232 ms for 6.24 tokens; 2 each (12 rows) would
    # cost 382 ms for 7.5; none: 4 tokens in 157 ms
    assert planner.plan(4, [4, 4, 4, 4], [0.56] * 4) == [1, 1, 1, 1]
    # drafts that are seldom right: none
    assert planner.plan(4, [4, 4, 4, 4], [0.2] * 4) == [0, 0, 0, 0]
    assert planner.plan(1, [4], [0.2]) == [1]  # 1.2 in 127 ms against 1 in 114
    # a request quoting its context drafts in a batch where the others do not
    assert planner.plan(4, [4, 4, 4, 4], [0.2, 0.97, 0.2, 0.2]) == [0, 4, 0, 0]


def test_what_proposing_costs_counts_against_drafts():
    planner = planner_with(QWEN_1_5B)
    assert planner.plan(1, [4], [0.3]) == [1]  # 1.3 tokens in 127 ms against 1 in 114
    for _ in range(20):  # a draft model: 35 ms a forward pass, 1 ms a row
        planner.observe_proposal(1, 1, 36.0)
        planner.observe_proposal(4, 9, 149.0)
    assert planner.plan(1, [4], [0.3]) == [0]  # 1.3 in 127 + 36 ms
    assert planner.plan(1, [4], [0.95]) == [4]


def test_requests_left_out_get_one_draft_ever_more_seldom_until_all_draft():
    planner = planner_with(QWEN_1_5B)
    caps, acceptance = [4, 2, 4, 4], [0.2, 0.2, 0.97, 0.2]
    probe, usual = [1, 1, 4, 1], [0, 0, 4, 0]

    def steps_to_probe() -> int:
        for n in range(1, PROBE_MAX + 1):
            ks = planner.plan(4, caps, acceptance)
            if ks == probe:
                return n
            assert ks == usual
        raise AssertionError("no probe")

    waits = [steps_to_probe() for _ in range(5)]
    assert waits == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, PROBE_MAX, PROBE_MAX]
    assert all(planner.plan(4, caps, [0.97] * 4))  # none left out: the wait starts over
    assert steps_to_probe() == PROBE_EVERY


def test_a_probe_whose_proposing_cost_decode_steps_stretches_the_wait():
    planner = planner_with(QWEN_1_5B)
    caps, acceptance = [4] * 4, [0.2] * 4

    def steps_to_probe() -> int:
        n = 1
        while planner.plan(4, caps, acceptance) != [1] * 4:
            n += 1
        return n

    assert steps_to_probe() == PROBE_EVERY
    planner.observe_proposal(1, 40, 3 * 157.0)  # 3 decode steps (157 ms at 4 sequences)
    assert steps_to_probe() == 3 * 2 * PROBE_EVERY
    planner.observe_proposal(1, 4, 1.0)  # a cheap probe
    assert steps_to_probe() == 4 * PROBE_EVERY


def draft_model_planner() -> DraftPlanner:
    """The plan of a 1.5B target beside a draft model whose forward pass costs 35 ms
    and each row it computes 2 ms more (a catch-up of 600 tokens: 1.2 s)."""
    planner = planner_with(QWEN_1_5B)
    for _ in range(10):
        for passes, rows in [(1, 1), (4, 9), (1, 200), (2, 60)]:
            planner.observe_proposal(passes, rows, 35.0 * passes + 2.0 * rows)
    return planner


def test_a_catch_up_is_charged_over_the_steps_a_request_has_left():
    planner = draft_model_planner()
    assert planner.plan(1, [4], [0.8]) == [2]  # a third draft is not worth its pass
    # a catch-up over a 600-token prompt pays for itself over a reply of 256 tokens (and,
    # paid once the request drafts at all, makes a third draft worth it)
    assert planner.plan(1, [4], [0.8], [600], [256]) == [3]
    # not over 20 tokens (7 steps of 2 drafts), where drafting a request caught up does
    assert planner.plan(1, [4], [0.8], [600], [20]) == [0]
    assert planner.plan(1, [4], [0.8], [2], [20]) == [2]


def test_probes_skip_requests_whose_catch_up_costs_more_than_half_a_step():
    planner = draft_model_planner()
    caps, acceptance = [4] * 4, [0.2] * 4

    def steps_to_probe(lags) -> tuple[int, list[int]]:
        for n in range(1, PROBE_MAX + 1):
            ks = planner.plan(4, caps, acceptance, lags, [256] * 4)
            if any(ks):
                return n, ks
        return PROBE_MAX + 1, [0] * 4

    # 10 rows and a pass: 55 ms, within half of the 157 ms step; 40 rows: 115 ms
    assert steps_to_probe([10, 40, 10, 40]) == (PROBE_EVERY, [1, 0, 1, 0])
    # none cheap enough: no probe, and the wait does not grow
    assert steps_to_probe([40] * 4) == (PROBE_MAX + 1, [0] * 4)
    assert steps_to_probe([1] * 4) == (2 * PROBE_EVERY, [1] * 4)


class Plans:
    """A planner that keeps every draft and records what it was asked."""

    def __init__(self) -> None:
        self.asked = []

    def plan(self, num_decoding, caps, acceptance, lags, tokens_left):
        self.asked.append((lags, tokens_left))
        return list(caps)

    def observe_proposal(self, *args):
        pass


class Lagging(Echo):
    def lag(self, request):
        return request.num_tokens


def test_the_plan_is_told_each_requests_catch_up_and_expected_tokens_left():
    plans = Plans()
    speculator = Speculator(Lagging(), num_tokens=4, planner=plans)
    short, long = (Request(r, [1, 2, 3], SamplingParams(max_tokens=n), n) for r, n in
                   [("short", 20), ("long", 1000)])  # fmt: skip
    speculator.propose([short, long], 4096)
    assert plans.asked[-1] == ([3, 3], [20, 128])  # recent replies' length: 128 at first
    done = Request("done", [1], SamplingParams(max_tokens=1000), 1000)
    done.token_ids += [5] * 8
    for _ in range(30):
        speculator.forget(done)  # replies of 8 tokens
    speculator.forget(Request("gone", [1], SamplingParams(max_tokens=1000), 1000), False)
    speculator.propose([short, long], 4096)
    lags, tokens_left = plans.asked[-1]
    assert tokens_left[0] == pytest.approx(8, abs=0.2) and tokens_left[1] == tokens_left[0]
    # an aborted request's length says nothing of how long replies run
    speculator.forget(Request("gone", [1], SamplingParams(max_tokens=1000), 1000), False)
    speculator.propose([short], 4096)
    assert plans.asked[-1][1] == [tokens_left[0]]


def test_a_new_batch_size_decodes_without_drafts_then_reaches_out_a_draft_at_a_time():
    # the model says rows are cheap (1 ms beside a 100 ms step)
    planner = planner_with({}, StepCoefficients(base=100, per_decode_row=1))
    plan = lambda: planner.plan(2, [3, 3], [0.5, 0.5])  # noqa: E731
    assert plan() == [0, 0]  # first: the rate to beat
    planner.observe_step(StepShape(num_decode_rows=2), 2, 100.0)
    assert plan() == [1, 1]  # then one draft each past the most rows measured
    planner.observe_step(StepShape(num_decode_rows=4), 2, 102.0)
    assert plan() == [2, 2]
    planner.observe_step(StepShape(num_decode_rows=6), 2, 400.0)  # those were not cheap
    planner.observe_step(StepShape(num_prefill_tokens=64, num_decode_rows=2), 2, 1.0)
    assert plan() == [1, 1]
    planner.observe_step(StepShape(num_decode_rows=4), 2, 1000.0)
    assert plan() == [0, 0]


def test_a_requests_acceptance_follows_its_verifications_from_the_overall_rate():
    speculator = Speculator(Echo(), num_tokens=4)
    a, b = (Request(r, [1, 2], SamplingParams(max_tokens=100), 100) for r in "ab")
    assert speculator.acceptance(a) == 0.5  # nothing seen
    for _ in range(10):
        speculator.observe(a, 4, 4)
    high = speculator.acceptance(a)
    assert high > 0.9
    assert 0.5 < speculator.acceptance(b) < high  # a new request: pulled toward the rate
    for _ in range(3):
        speculator.observe(a, 4, 0)
    assert speculator.acceptance(a) < 0.85  # recent verifications count most


class Never(Proposer):
    """Drafts that are always wrong (token 0 never follows on these models' outputs)."""

    def propose(self, requests, num_tokens):
        return [[0] * k for k in num_tokens]


class FixedCosts(DecodeCosts):
    """Decode steps cost 100 ms + 4 ms a row, whatever the box measures."""

    def observe(self, num_seqs, num_rows, ms):
        pass

    def seen(self, num_seqs, num_rows):
        return True

    def most_rows(self, num_seqs):
        return 1 << 30

    def predict(self, num_seqs, num_rows):
        return 100.0 + 4.0 * num_rows


@pytest.mark.plans_drafts
def test_engine_keeps_drafts_that_are_accepted_and_drops_those_that_are_not(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 4
    want, plain = _run(path, prompts, params)
    reference = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want, strict=True)}
    spec = dict(speculative_method="ngram", num_speculative_tokens=4)

    def run(proposer):
        from ember import LLM

        llm = LLM(str(path), **SMALL, **spec)
        core = llm.engine.core
        core.speculator.proposer = proposer
        planner = core.speculator.planner
        planner.decode_costs = FixedCosts(planner.decode_costs.fallback)
        got = llm.generate(prompts, params)
        assert core.kv_cache.check_integrity()
        return got, core.stats().spec_decode

    got, stats = run(Oracle(reference))  # 4 of 5 drafts right: drafted throughout
    _assert_same(want, got)
    assert stats["num_draft_tokens"] > 60 and stats["num_accepted_tokens"] > 40, stats
    got, stats = run(Never())
    _assert_same(want, got)
    # the first verifications find them wrong; after that only probes (one draft each)
    assert stats["num_draft_tokens"] < 40, stats
    assert stats["num_accepted_tokens"] == 0

"""Sampling: what a user sees of temperature, top-k/p, min-p, seeds, penalties, logprobs.

Unit tests call `Sampler()(logits, requests)` on fabricated logits; a few run the tiny
random checkpoint end to end. Every random draw is seeded, so nothing can flake.
"""

from __future__ import annotations

import math

import pytest
import torch

from ember import LLM, SamplingParams
from ember.engine.request import Request
from ember.engine.sampler import Sampler, apply_penalties, argmax_rows

sample = Sampler()


def make_request(
    params: SamplingParams, prompt: list[int] = (0,), output: list[int] = (), rid: str = "r"
) -> Request:
    request = Request(rid, list(prompt), params, max_tokens=64)
    request.token_ids.extend(output)
    return request


def draw(logits: torch.Tensor, params: SamplingParams, num_draws: int, seed: int = 0):
    """`num_draws` independent samples from one row of logits (unseeded requests: each
    draws its own seed from the global RNG)."""
    torch.manual_seed(seed)
    requests = [make_request(params) for _ in range(num_draws)]
    out = sample(logits.expand(num_draws, -1).clone(), requests)
    return torch.tensor(out.token_ids)


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    assert counts[expected == 0].sum() == 0, "sampled a token of probability 0"
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


# Loose bound: the 1e-6 upper quantile of chi-square with <= 12 degrees of freedom is ~46.
CHI2_BOUND = 50.0


# --- greedy, temperature, top-k, top-p, min-p -------------------------------------------


def test_greedy_is_argmax_per_row():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 40, generator=gen)
    requests = [make_request(SamplingParams(temperature=0.0, seed=i)) for i in range(6)]
    assert sample(logits, requests).token_ids == logits.argmax(-1).tolist()


def test_argmax_rows_is_argmax_with_its_ties_nans_and_infinities():
    """Greedy takes each row's first maximum (a NaN's index where a row has one), as
    torch's argmax does, from max's indices, which are faster to get."""
    nan, inf = float("nan"), float("inf")
    rows = torch.tensor(
        [[1.0, 3.0, 3.0, 2.0], [nan, 1.0, nan, 5.0], [-inf] * 4, [2.0, inf, inf, 0.0], [0.0] * 4]
    )
    assert argmax_rows(rows).tolist() == rows.argmax(dim=-1).tolist() == [1, 0, 0, 1, 0]
    generator = torch.Generator().manual_seed(0)
    for _ in range(20):  # few distinct values: ties everywhere
        logits = torch.randint(0, 4, (5, 49152), generator=generator).float()
        assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))


def test_temperature_zero_is_deterministic_and_positive_temperature_is_not():
    logits = torch.linspace(0.0, 0.5, 20)  # nearly flat, argmax = 19
    greedy = draw(logits, SamplingParams(temperature=0.0), 2000)
    assert set(greedy.tolist()) == {19}
    sampled = draw(logits, SamplingParams(temperature=1.0), 2000)
    assert len(set(sampled.tolist())) == 20


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_sampled_frequencies_follow_softmax_of_logits_over_temperature(temperature):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 1.5])
    tokens = draw(logits, SamplingParams(temperature=temperature), 20000, seed=1)
    probs = torch.softmax(logits / temperature, -1)
    assert chi_square(tokens, probs) < CHI2_BOUND
    # the same test does reject a wrong distribution
    assert chi_square(tokens, torch.softmax(logits / (temperature * 2), -1)) > 10 * CHI2_BOUND


def test_top_k_never_leaves_the_k_best():
    logits = torch.randn(100, generator=torch.Generator().manual_seed(3))
    best = set(logits.topk(5).indices.tolist())
    tokens = draw(logits, SamplingParams(temperature=2.0, top_k=5), 5000)
    assert set(tokens.tolist()) == best  # all of the 5 and nothing else
    probs = torch.zeros(100)
    probs[list(best)] = torch.softmax(logits[list(best)] / 2.0, -1)
    assert chi_square(tokens, probs) < CHI2_BOUND


# 0.4, 0.3, 0.2, then ten tokens of 0.01
NUCLEUS_PROBS = torch.tensor([0.4, 0.3, 0.2] + [0.01] * 10)


@pytest.mark.parametrize(("top_p", "nucleus"), [(0.35, [0]), (0.65, [0, 1]), (0.75, [0, 1, 2])])
def test_top_p_samples_only_the_nucleus_renormalised(top_p, nucleus):
    logits = NUCLEUS_PROBS.log()
    tokens = draw(logits, SamplingParams(top_p=top_p), 8000)
    assert set(tokens.tolist()) == set(nucleus)
    probs = torch.zeros_like(NUCLEUS_PROBS)
    probs[nucleus] = NUCLEUS_PROBS[nucleus] / NUCLEUS_PROBS[nucleus].sum()
    assert chi_square(tokens, probs) < CHI2_BOUND


def test_min_p_drops_tokens_below_fraction_of_the_best():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.05, 0.03, 0.02])
    tokens = draw(probs.log(), SamplingParams(min_p=0.15), 8000)  # threshold 0.075
    assert set(tokens.tolist()) == {0, 1, 2}
    expected = torch.tensor([0.5, 0.3, 0.1, 0, 0, 0]) / 0.9
    assert chi_square(tokens, expected) < CHI2_BOUND


def test_each_row_of_a_mixed_batch_obeys_its_own_parameters():
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(50, generator=gen) * 0.3  # flat: constraints do all the work
    order = logits.argsort(descending=True).tolist()
    kinds = [
        (SamplingParams(temperature=0.0), {order[0]}),
        (SamplingParams(top_k=2), set(order[:2])),
        (SamplingParams(top_k=3, seed=11), set(order[:3])),
        (SamplingParams(), set(range(50))),
    ]
    torch.manual_seed(0)
    # 500 rounds: at 500 positions (a seeded request's draw depends on its position)
    requests = [make_request(p, output=[1] * j, rid=f"r{i}.{j}")
                for j in range(500) for i, (p, _) in enumerate(kinds)]  # fmt: skip
    tokens = sample(logits.expand(len(requests), -1).clone(), requests).token_ids
    for i, (_, allowed) in enumerate(kinds):
        seen = set(tokens[i :: len(kinds)])
        assert seen <= allowed
        assert seen == allowed if len(allowed) <= 3 else len(seen) > 40


# --- per-request seeds -------------------------------------------------------------------


def run_steps(requests: list[Request], target: int, num_steps: int = 25) -> list[int]:
    """Tokens drawn for requests[target] over `num_steps` steps of fresh random logits."""
    gen = torch.Generator().manual_seed(99)
    out = []
    for _ in range(num_steps):
        logits = torch.randn(len(requests), 64, generator=gen)
        logits[target] = torch.randn(64, generator=torch.Generator().manual_seed(len(out)))
        tokens = sample(logits, requests).token_ids
        for request, token in zip(requests, tokens, strict=True):
            request.token_ids.append(token)  # each step draws at the next position
        out.append(tokens[target])
    return out


def test_seeded_request_draws_the_same_tokens_alone_or_in_any_batch():
    def seeded(seed=42):
        return make_request(SamplingParams(temperature=1.0, top_k=40, seed=seed), rid="s")

    torch.manual_seed(0)
    alone = run_steps([seeded()], 0)
    torch.manual_seed(1)
    batch = [
        make_request(SamplingParams(temperature=1.0)),
        make_request(SamplingParams(temperature=0.0)),
        make_request(SamplingParams(temperature=0.7, seed=3)),
        seeded(),
        make_request(SamplingParams(top_p=0.5)),
    ]
    assert run_steps(batch, 3) == alone
    torch.manual_seed(2)
    assert run_steps([make_request(SamplingParams()), seeded()], 1) == alone
    assert run_steps([seeded(43)], 0) != alone
    assert run_steps([seeded(44)], 0) != alone


@pytest.mark.parametrize("seed", [-1, -(2**63), 2**63 - 1])
def test_any_int64_seed_is_reproducible_and_siblings_wrap_within_int64(seed):
    def seeded(index=0):
        params = SamplingParams(temperature=1.0, seed=seed, n=2).sibling(index)
        return make_request(params, rid="s")

    torch.manual_seed(0)
    first = run_steps([seeded()], 0)
    torch.manual_seed(1)
    assert run_steps([make_request(SamplingParams()), seeded()], 1) == first
    assert run_steps([seeded(1)], 0) != first  # the second sequence draws its own tokens
    assert -(2**63) <= SamplingParams(seed=seed).sibling(1).seed < 2**63


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24)


def test_seeded_generate_is_identical_alone_and_batched(llm):
    prompt = "The quick brown fox"
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=12)
    alone = llm.generate(prompt, seeded)[0].outputs[0]
    others = [
        ("def main():", SamplingParams(temperature=1.0, max_tokens=9)),
        ("Größe, naïve café", SamplingParams(temperature=1.0, seed=8, max_tokens=15)),
        ("0123456789 0123", SamplingParams(temperature=0.0, max_tokens=5)),
    ]
    prompts = [others[0][0], prompt, others[1][0], others[2][0]]
    params = [others[0][1], seeded, others[1][1], others[2][1]]
    batched = llm.generate(prompts, params)[1].outputs[0]
    assert batched.token_ids == alone.token_ids
    assert batched.text == alone.text
    other_seed = llm.generate(prompt, SamplingParams(temperature=1.0, seed=8, max_tokens=12))
    assert other_seed[0].outputs[0].token_ids != alone.token_ids


def test_top_k_one_end_to_end_equals_greedy(llm):
    prompt = "Agents resend their whole context"
    greedy = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=10))
    top1 = llm.generate(prompt, SamplingParams(temperature=1.5, top_k=1, max_tokens=10))
    assert top1[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids


# --- penalties ---------------------------------------------------------------------------

LOGITS = [2.0, -1.0, 0.5, -0.5, 1.0, 0.0]
PROMPT = [0, 3]
OUTPUT = [2, 2, 3, 5]  # counts: token 2 twice, 3 once (also in prompt), 5 once


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        # OpenAI: logit - presence * [count > 0], output tokens only (token 0 is prompt-only)
        (dict(presence_penalty=0.5), [2.0, -1.0, 0.0, -1.0, 1.0, -0.5]),
        # OpenAI: logit - frequency * count
        (dict(frequency_penalty=0.3), [2.0, -1.0, -0.1, -0.8, 1.0, -0.3]),
        # HF: prompt and output tokens, positive logits divided, others multiplied
        (dict(repetition_penalty=2.0), [1.0, -1.0, 0.25, -1.0, 1.0, 0.0]),
        (dict(repetition_penalty=0.5), [4.0, -1.0, 1.0, -0.25, 1.0, 0.0]),
        # negative presence/frequency encourage repeats
        (dict(presence_penalty=-1.0, frequency_penalty=-0.5), [2.0, -1.0, 2.5, 1.0, 1.0, 1.5]),
        # all at once: repetition first, then frequency and presence
        (
            dict(repetition_penalty=2.0, frequency_penalty=0.3, presence_penalty=0.5),
            [1.0, -1.0, -0.85, -1.8, 1.0, -0.8],
        ),
    ],
)
def test_penalties_change_logits_as_openai_and_hf_define_them(params, expected):
    penalized = make_request(SamplingParams(**params), PROMPT, OUTPUT)
    plain = make_request(SamplingParams(), [1], [4, 4, 4])  # same batch, no penalties
    logits = torch.tensor([LOGITS, LOGITS])
    out = apply_penalties(logits, [penalized, plain])
    torch.testing.assert_close(out[0], torch.tensor(expected))
    torch.testing.assert_close(out[1], torch.tensor(LOGITS))


def test_presence_penalty_changes_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0], [3.0, 2.5, 0.0]])
    requests = [
        make_request(SamplingParams(temperature=0.0), [1], [0]),
        make_request(SamplingParams(temperature=0.0, presence_penalty=1.0), [1], [0]),
    ]
    assert sample(logits, requests).token_ids == [0, 1]


# --- logprobs ----------------------------------------------------------------------------


def test_logprobs_are_log_softmax_of_raw_logits_with_sampled_token_first():
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(4, 30, generator=gen) * 2
    # row 1: frequency penalty pushes greedy off the raw top-1 (sampled token outside top-n)
    raw_best = int(logits[1].argmax())
    requests = [
        make_request(SamplingParams(temperature=0.8, logprobs=5, seed=1)),
        make_request(
            SamplingParams(temperature=0.0, logprobs=1, frequency_penalty=2.0), [0], [raw_best] * 10
        ),
        make_request(SamplingParams(temperature=1.0, seed=2)),  # no logprobs asked
        make_request(SamplingParams(temperature=1.0, logprobs=0, seed=3)),
    ]
    out = sample(logits, requests)
    expected = torch.log_softmax(logits, -1)
    for row, num in [(0, 5), (1, 1), (3, 0)]:
        entry = out.logprobs[row]
        token = out.token_ids[row]
        assert next(iter(entry)) == token
        top = expected[row].topk(num).indices.tolist() if num else []
        assert set(entry) == {token, *top}
        for t, value in entry.items():
            assert value == pytest.approx(float(expected[row, t]), abs=1e-5)
    assert out.logprobs[2] is None
    assert out.token_ids[1] != raw_best and len(out.logprobs[1]) == 2


def test_logprobs_sum_to_one_over_the_vocabulary():
    logits = torch.randn(1, 8, generator=torch.Generator().manual_seed(0))
    request = make_request(SamplingParams(temperature=0.0, logprobs=8))
    entry = sample(logits, [request]).logprobs[0]
    assert len(entry) == 8
    assert math.fsum(math.exp(v) for v in entry.values()) == pytest.approx(1.0, abs=1e-5)


# --- SamplingParams validation -----------------------------------------------------------


@pytest.mark.parametrize(
    ("param", "kwargs"),
    [
        ("temperature", dict(temperature=-0.1)),
        ("temperature", dict(temperature=float("nan"))),
        ("top_p", dict(top_p=0.0)),
        ("top_p", dict(top_p=1.5)),
        ("n", dict(n=0)),
        ("max_tokens", dict(max_tokens=0)),
        ("top_k", dict(top_k=-2)),
        ("min_p", dict(min_p=2.0)),
        ("logprobs", dict(logprobs=21)),
        ("logprobs", dict(logprobs=-1)),
        ("presence_penalty", dict(presence_penalty=3.0)),
        ("frequency_penalty", dict(frequency_penalty=-2.5)),
        ("repetition_penalty", dict(repetition_penalty=0.0)),
        ("stop", dict(stop="")),
        ("stop", dict(stop=["END", ""])),
        ("stop_token_ids", dict(stop_token_ids=[-1])),
        ("stop_token_ids", dict(stop_token_ids=[2**63])),
        ("temperature", dict(temperature=2.5)),
        ("temperature", dict(temperature=math.inf)),
        ("n", dict(n=129)),
        ("seed", dict(seed=2**63)),
        ("seed", dict(seed=-(2**63) - 1)),
        ("top_k", dict(top_k=2**63)),
        ("repetition_penalty", dict(repetition_penalty=math.inf)),
        ("max_tokens", dict(max_tokens=2**63)),
    ],
)
def test_invalid_sampling_params_raise_value_error_naming_the_parameter(param, kwargs):
    with pytest.raises(ValueError, match=rf"^{param}\b"):
        SamplingParams(**kwargs)


def test_boundary_sampling_params_are_accepted():
    params = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        logprobs=20,
        presence_penalty=2.0,
        frequency_penalty=-2.0,
        max_tokens=1,
        stop="END",
    )
    assert SamplingParams(n=128, temperature=2, seed=-(2**63), repetition_penalty=2.0).n == 128
    assert params.top_k == 0  # -1 means off
    assert params.stop == ["END"]
    assert params.greedy

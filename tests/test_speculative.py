"""Speculative decoding: the ngram proposer, the adaptive number of drafts, the
scheduler's bookkeeping of accepted and rejected drafts, the sampler's verification
(greedy, and a random request's own draws), and whole engines whose output must equal
decoding without drafts."""

from __future__ import annotations

import random
from collections import Counter

import httpx
import numpy as np
import pytest
import torch

from conftest import CORPUS
from ember import LLM, SamplingParams
from ember.config import EngineConfig
from ember.engine import sampler as sampler_module
from ember.engine.core import EngineCore
from ember.engine.kv_cache import KVCacheManager, hash_block, root_hash
from ember.engine.messages import EngineCoreRequest
from ember.engine.request import Request
from ember.engine.sampler import Sampler
from ember.engine.scheduler import Scheduler
from ember.engine.speculative import COOLDOWN_STEPS, NgramProposer, Proposer, Speculator
from ember.engine.structured_output import json_schema_grammar
from ember.models.layers import cpu_has_bf16
from server_utils import EmberServer

pytestmark = pytest.mark.usefixtures("every_draft")

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)

# -- the ngram proposer ----------------------------------------------------------------


def lookup(tokens: list[int], k: int = 4, min_n: int = 2, max_n: int = 5) -> list[int]:
    return NgramProposer(min_n, max_n).lookup(np.array(tokens, dtype=np.int64), k)


def test_ngram_proposes_what_followed_the_suffix_before():
    assert lookup([1, 2, 3, 4, 5, 9, 1, 2]) == [3, 4, 5, 9]
    assert lookup([1, 2, 3, 4, 5, 9, 1, 2], k=2) == [3, 4]
    assert lookup([1, 2, 3, 1, 2]) == [3, 1, 2, 3]  # runs into the suffix: a repeat
    assert lookup([7, 1, 2, 1, 2], k=5) == [1, 2, 1, 2, 1]


def test_ngram_prefers_the_longest_suffix_then_the_most_recent():
    # "7 1 2" occurred once (followed by 8); "1 2" most recently followed by 9
    tokens = [7, 1, 2, 8, 0, 1, 2, 9, 0, 7, 1, 2]
    assert lookup(tokens, k=1) == [8]
    assert lookup(tokens, k=1, max_n=2) == [9]  # only 2-grams: the most recent match


def test_ngram_needs_min_n_matching_tokens():
    assert lookup([5, 2, 6, 3, 2]) == []  # only "2" repeats
    assert lookup([5, 2, 6, 3, 2], min_n=1) == [6, 3, 2, 6]
    assert lookup([1]) == [] and lookup([1, 1]) == []
    assert lookup([1, 1, 1], min_n=2) == [1, 1, 1, 1]


def test_ngram_proposer_follows_a_growing_request():
    proposer = NgramProposer(2, 3)
    request = Request("r", [1, 2, 3, 4], GREEDY, 8)
    assert proposer.propose([request], [3]) == [[]]
    request.token_ids += [9] * 300 + [1, 2]  # past the array's first size
    assert proposer.propose([request], [3]) == [[3, 4, 9]]
    assert proposer.propose([request], [0]) == [[]]


# -- how many drafts a request gets ------------------------------------------------------


class Echo(Proposer):
    """Proposes tokens 0, 1, ... (as many as asked)."""

    def propose(self, requests, num_tokens):
        return [list(range(k)) for k in num_tokens]


def test_adaptive_drafts_halve_to_off_then_come_back_and_grow():
    speculator = Speculator(Echo(), num_tokens=4)
    request = Request("r", [1, 2], SamplingParams(max_tokens=1000), 1000)
    assert speculator.propose([request], 4096) == {"r": [0, 1, 2, 3]}
    speculator.observe(request, 4, 0)
    assert speculator.propose([request], 4096)["r"] == [0, 1]
    speculator.observe(request, 2, 0)
    assert speculator.propose([request], 4096)["r"] == [0]
    speculator.observe(request, 1, 0)  # off for a while
    for _ in range(COOLDOWN_STEPS[0]):
        assert speculator.propose([request], 4096) == {}
    assert speculator.propose([request], 4096)["r"] == [0]
    speculator.observe(request, 1, 0)  # off again, twice as long
    for _ in range(2 * COOLDOWN_STEPS[0]):
        assert speculator.propose([request], 4096) == {}
    speculator.observe(request, 1, 1)
    assert speculator.propose([request], 4096)["r"] == [0, 1]  # all accepted: doubles
    speculator.observe(request, 2, 2)
    assert len(speculator.propose([request], 4096)["r"]) == 4  # capped
    speculator.observe(request, 4, 1)
    assert len(speculator.propose([request], 4096)["r"]) == 2  # one past what was kept
    stats = speculator.stats.as_dict()
    counts = stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]
    assert counts == (7, 15, 4)
    assert stats["accepted_per_position"] == [3, 1, 0, 0]


def test_drafts_stop_at_max_tokens_and_the_context():
    speculator = Speculator(Echo(), num_tokens=8, adaptive=False)
    request = Request("r", [1, 2], SamplingParams(max_tokens=4), 4)
    request.token_ids.append(5)  # one output token: 3 left, the last the target's own
    assert speculator.propose([request], 4096)["r"] == [0, 1]
    assert speculator.propose([request], 5)["r"] == [0]
    assert speculator.propose([request], 4) == {}  # the context's last token: the target's


def test_no_drafts_from_the_batch_size_that_disables_them():
    speculator = Speculator(Echo(), num_tokens=2, adaptive=False, disable_by_batch_size=3)
    requests = [Request(f"r{i}", [1, 2], SamplingParams(max_tokens=40), 40) for i in range(3)]
    assert list(speculator.propose(requests[:2], 4096)) == ["r0", "r1"]
    assert speculator.propose(requests, 4096) == {}
    with pytest.raises(ValueError, match="speculative_disable_by_batch_size"):
        EngineConfig(speculative_method="ngram", speculative_disable_by_batch_size=0)


class FirstOnly:
    """A grammar that takes one token of any draft."""

    def valid_prefix(self, tokens):
        return min(len(tokens), 1)


def test_drafts_are_cut_to_what_a_grammar_takes():
    speculator = Speculator(Echo(), num_tokens=8, adaptive=False)
    request = Request("r", [1, 2], SamplingParams(max_tokens=40), 40)
    request.grammar = FirstOnly()
    assert speculator.propose([request], 4096) == {"r": [0]}


# -- the scheduler: accepted drafts committed, rejected ones never cached ----------------


class SpecFakeRunner:
    """Runs scheduled steps on fake KV: each slot holds the tokens it was computed from,
    so a read of KV that a rejected draft left behind shows. Drafts are accepted for a
    random prefix; the target's own token is random."""

    def __init__(self, scheduler: Scheduler, rng: random.Random) -> None:
        self.scheduler, self.rng = scheduler, rng
        self.bs = scheduler.kv_cache.block_size
        self.kv: dict[tuple[int, int], tuple] = {}
        self.tokens_of: dict[bytes, tuple] = {}  # block hash -> the tokens it covers
        self.num_drafts = self.num_accepted = 0

    def step(self) -> None:
        running = [r for r in self.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        drafts = {r.request_id: [self.rng.randrange(50) for _ in range(3)] for r in running}
        out = self.scheduler.schedule(drafts)
        sampled = {}
        for sched in out.scheduled:
            request, start = sched.request, sched.request.num_computed_tokens
            known = request.token_ids[start : start + sched.num_new_tokens]
            rows = [*known, *sched.spec_token_ids]
            assert not sched.spec_token_ids or sched.num_new_tokens == 1
            context = request.token_ids[:start]
            for i, token in enumerate(rows):
                pos = start + i
                context = [*context, token]
                self.kv[self._slot(sched.block_ids, pos)] = tuple(context)
            for pos in range(start + len(rows)):  # attention reads all of it
                expected = tuple((request.token_ids[:start] + rows)[: pos + 1])
                assert self.kv[self._slot(sched.block_ids, pos)] == expected, pos
            if sched.samples:
                accepted = self.rng.randint(0, len(sched.spec_token_ids))
                own = self.rng.randrange(50)
                sampled[request.request_id] = [*sched.spec_token_ids[:accepted], own]
                self.num_drafts += len(sched.spec_token_ids)
                self.num_accepted += accepted
        self.scheduler.update(out, sampled)
        for sched in out.scheduled:  # finished ones too
            self._note_hashes(sched.request)
        self._check_cached_blocks()

    def _slot(self, block_ids: list[int], pos: int) -> tuple[int, int]:
        return block_ids[pos // self.bs], pos % self.bs

    def _note_hashes(self, request: Request) -> None:
        for i, block_hash in enumerate(request.block_hashes):
            self.tokens_of[block_hash] = tuple(request.token_ids[: (i + 1) * self.bs])

    def _check_cached_blocks(self) -> None:
        """Every findable block holds the KV of exactly the tokens its hash covers."""
        kv_cache = self.scheduler.kv_cache
        assert kv_cache.check_integrity()
        for block_hash, block in kv_cache.pool.cached.items():
            tokens = self.tokens_of[block_hash]
            for offset in range(self.bs):
                pos = len(tokens) - self.bs + offset
                assert self.kv[(block.block_id, offset)] == tokens[: pos + 1]


@pytest.mark.parametrize("seed", range(4))
def test_drafts_accepted_or_rejected_never_corrupt_the_kv_or_the_prefix_cache(seed):
    rng = random.Random(seed)
    kv_cache = KVCacheManager(num_blocks=24, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv_cache, max_num_batched_tokens=24, max_num_seqs=6, max_model_len=90)
    runner = SpecFakeRunner(scheduler, rng)
    shared = [rng.randrange(50) for _ in range(10)]
    for i in range(10):
        prompt = shared + [rng.randrange(50) for _ in range(rng.randint(1, 20))]
        max_tokens = rng.randint(1, 50)
        params = SamplingParams(max_tokens=max_tokens)
        scheduler.add(Request(f"r{i}", prompt, params, max_tokens, eos_token_ids=frozenset({0})))
    for _ in range(500):
        if not scheduler.num_unfinished:
            break
        runner.step()
    assert not scheduler.num_unfinished
    assert runner.num_accepted > 0 and runner.num_drafts > runner.num_accepted
    assert scheduler.num_preemptions > 0  # 24 blocks of 4 are short for 6 at once
    assert kv_cache.num_free_blocks == kv_cache.num_blocks


def test_a_decode_takes_its_drafts_only_where_blocks_and_budget_allow():
    kv_cache = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    scheduler = Scheduler(kv_cache, max_num_batched_tokens=3, max_num_seqs=4, max_model_len=64)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=20), 20)
    scheduler.add(request)
    out = scheduler.schedule()
    scheduler.update(out, {"r": [4]})
    out = scheduler.schedule({"r": [5, 6, 7, 8]})
    assert out.scheduled[0].spec_token_ids == [5, 6]  # the step's 3 tokens
    assert out.num_scheduled_tokens == 3 and out.shape().num_decode_rows == 3
    scheduler.update(out, {"r": [5, 6, 9]})  # both accepted, then the target's 9
    assert request.token_ids == [1, 2, 3, 4, 5, 6, 9] and request.num_computed_tokens == 6
    # the first block's 4 tokens are findable, and nothing past the computed tokens
    assert kv_cache.pool.cached == {
        hash_block(root_hash(None), [1, 2, 3, 4]): kv_cache.pool.blocks[kv_cache.block_ids("r")[0]]
    }
    out = scheduler.schedule({"r": [1] * 20})  # 8 more slots would need 2 blocks: 1 is free
    assert out.scheduled[0].spec_token_ids == [1, 1]
    scheduler.update(out, {"r": [3]})  # the first draft rejected
    assert request.num_computed_tokens == 7 and request.token_ids[-1] == 3


# -- the sampler's verification ---------------------------------------------------------


def _request(i: int, **params) -> Request:
    request = Request(f"r{i}", [3, 4, 5], SamplingParams(**params), 50)
    request.token_ids += [6, 7]
    return request


def sequential(logits: torch.Tensor, request: Request, draft: list[int]) -> list[int]:
    """What decoding without drafts would output from these rows: a token per row, the
    request growing by it, until a token differs from the draft."""
    out = []
    for i in range(len(draft) + 1):
        token = Sampler()(logits[i : i + 1], [request]).token_ids[0]
        out.append(token)
        request.token_ids.append(token)
        if i == len(draft) or token != draft[i]:
            break
    del request.token_ids[-len(out) :]
    return out


@pytest.mark.parametrize(
    "params",
    [
        {},
        {"repetition_penalty": 2.0},
        {"presence_penalty": 2.0, "frequency_penalty": 1.5},
        {"min_tokens": 4},
        {"logit_bias": {2: 5.0, 7: -3.0}},
    ],
)
def test_greedy_verification_outputs_what_decoding_without_drafts_would(params):
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        draft_len = trial % 5
        logits = torch.randn(draft_len + 1, 10, generator=gen) * 2
        request = _request(trial, temperature=0.0, **params)
        request.eos_token_ids = frozenset({1})
        # drafts that the rows' own argmax mostly confirms, sometimes not
        targets = logits.argmax(-1).tolist()
        draft = [t if torch.rand((), generator=gen) < 0.7 else (t + 1) % 10 for t in targets]
        draft = draft[:draft_len]
        want = sequential(logits, request, draft)
        tokens, logprobs = Sampler().verify(logits, [request], [draft])
        assert tokens == [want] and logprobs == [None]


def test_verification_rows_mix_requests_with_and_without_drafts_and_logprobs():
    logits = torch.randn(6, 10, generator=torch.Generator().manual_seed(1))
    targets = logits.argmax(-1).tolist()
    a = _request(0, temperature=0.0, logprobs=2)
    b = _request(1, temperature=0.0)
    c = _request(2, temperature=0.0, logprobs=0)
    drafts = [[targets[0], targets[1] + 1], [], [targets[4]]]  # rows 0-2, 3, 4-5
    tokens, logprobs = Sampler().verify(logits, [a, b, c], [d[:] for d in drafts])
    assert tokens == [[targets[0], targets[1]], [targets[3]], [targets[4], targets[5]]]
    raw = torch.log_softmax(logits, -1)
    assert logprobs[1] is None
    assert [list(e) for e in logprobs[2]] == [[targets[4]], [targets[5]]]
    first = logprobs[0][0]
    assert list(first)[0] == targets[0] and len(first) == 2  # the token first, then top-2
    assert first[targets[0]] == pytest.approx(float(raw[0, targets[0]]))
    assert logprobs[0][1][targets[1]] == pytest.approx(float(raw[1, targets[1]]))


def chi2_p_value(table: list[list[int]]) -> float:
    """The p-value of Pearson's chi-square test that the rows come from one distribution."""
    counts = torch.tensor(table, dtype=torch.float64)
    counts = counts[:, counts.sum(0) > 0]
    expected = counts.sum(1, keepdim=True) * counts.sum(0, keepdim=True) / counts.sum()
    statistic = ((counts - expected) ** 2 / expected).sum()
    dof = (counts.shape[0] - 1) * (counts.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), statistic / 2))


def _first_two(draws: list[list[int]]) -> list[int]:
    return [d[0] * 100 + (d[1] if len(d) > 1 else 99) for d in draws]


def _random_draws(logits, draft, n: int, seed: int) -> list[list[int]]:
    requests = [_request(i, temperature=1.0, top_k=0, seed=seed + i) for i in range(n)]
    return [Sampler().verify(logits, [r], [draft])[0][0] for r in requests]


def _plain_draws(logits, n: int, seed: int) -> list[list[int]]:
    out = []
    for i in range(n):
        request = _request(i, temperature=1.0, seed=seed + i)
        first = Sampler()(logits[:1], [request]).token_ids[0]
        request.token_ids.append(first)
        second = Sampler()(logits[1:2], [request]).token_ids[0]
        out.append([first, second])
    return out


def _table(spec: list[list[int]], plain: list[list[int]]) -> list[list[int]]:
    """Counts of (first token, second token when the first was the draft)."""
    keys = sorted(set(_first_two(spec)) | set(_first_two(plain)))
    counts = [Counter(_first_two(spec)), Counter(_first_two(plain))]
    return [[c[k] for k in keys] for c in counts]


def _plain_truncated(plain: list[list[int]], draft: list[int]) -> list[list[int]]:
    """Plain draws cut where they leave the draft (what verification would emit)."""
    return [p if p[0] == draft[0] else p[:1] for p in plain]


def test_drawn_verification_keeps_the_target_distribution_and_a_biased_verifier_fails(
    monkeypatch,
):
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0], [0.0, 1.0, 2.0, 0.5, 0.0]])
    draft = [1]  # the second most likely first token
    plain = _plain_truncated(_plain_draws(logits, 3000, 10_000), draft)
    spec = _random_draws(logits, draft, 3000, 50_000)
    assert chi2_p_value(_table(spec, plain)) > 0.01
    accepted = sum(1 for s in spec if s[0] == draft[0])
    assert 0.2 < accepted / len(spec) < 0.32  # p(1) = 0.26, as rejection sampling keeps it
    # with the same seeds, the very tokens of drawing without drafts
    same = _random_draws(logits, draft, 300, 10_000)
    assert same == _plain_truncated(_plain_draws(logits, 300, 10_000), draft)

    drawn = sampler_module._accept_drawn

    def biased(draft, probs, request):  # keeps a third of the drafts it should not
        got = drawn(draft, probs, request)
        if got[0] != draft[0] and request.seed % 3 == 0:
            return [draft[0], int(probs[1].argmax())]
        return got

    monkeypatch.setattr(sampler_module, "_accept_drawn", biased)
    spec = _random_draws(logits, draft, 3000, 50_000)
    assert chi2_p_value(_table(spec, plain)) < 1e-6


# -- whole engines ------------------------------------------------------------------------


class Table(Proposer):
    """Drafts the token a table gives for a request's first output token."""

    def __init__(self, table: dict[int, int]) -> None:
        self.table = table

    def propose(self, requests, num_tokens):
        out = []
        for request, k in zip(requests, num_tokens, strict=True):
            first = request.output_token_ids[:1]  # none yet: the prompt's last chunk
            out.append([self.table[t] for t in first][:k])
        return out


def test_sampling_with_drafts_keeps_the_models_distribution(tiny_checkpoint, monkeypatch):
    """On the tiny model, temperature 1 and top-k 4: the first two output tokens of 600
    seeded requests, with drafts (the greedy next token, accepted or rejected) and
    without, come from one distribution by a chi-square test; a verifier that keeps every
    draft fails it."""
    path, prompt = str(tiny_checkpoint("llama")), _prompts()[2][:20]
    plain = LLM(path, **SMALL, max_num_seqs=128)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    firsts = plain.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1, logprobs=4))
    table = {t: plain.generate([prompt + [t]], greedy)[0].outputs[0].token_ids[0]
             for t in firsts[0].outputs[0].logprobs[0]}  # fmt: skip

    def pairs(llm, seed: int) -> list[int]:
        params = [SamplingParams(temperature=1.0, top_k=4, max_tokens=3, seed=seed + i)
                  for i in range(600)]  # fmt: skip
        outs = llm.generate([prompt] * 600, params)
        return [o.outputs[0].token_ids[0] * 1000 + o.outputs[0].token_ids[1] for o in outs]

    spec = LLM(path, **SMALL, max_num_seqs=128, speculative_method="ngram",
               speculative_adaptive=False)  # fmt: skip
    spec.engine.core.speculator.proposer = Table(table)
    want = Counter(pairs(plain, 0))

    def p_value() -> float:
        got = Counter(pairs(spec, 100_000))
        keys = sorted(set(want) | set(got))
        return chi2_p_value([[want[k] for k in keys], [got[k] for k in keys]])

    assert p_value() > 0.01
    stats = spec.engine.core.stats().spec_decode
    assert stats["num_drafts"] == 600 and 150 < stats["num_accepted_tokens"] < 550

    drawn = sampler_module._accept_drawn

    def keep_all(draft, probs, request):
        return [*draft, *drawn([], probs[len(draft) :], request)]

    monkeypatch.setattr(sampler_module, "_accept_drawn", keep_all)
    assert p_value() < 1e-6


SMALL = dict(kv_cache_memory=1 << 22, max_model_len=256)


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    loop = [rng.randrange(3, 500) for _ in range(12)]
    return [
        loop * 4,  # drafts from the prompt
        loop * 2 + [rng.randrange(3, 500) for _ in range(30)],
        [rng.randrange(3, 500) for _ in range(40)],
        loop * 3 + loop[:5],
    ]


class Oracle(Proposer):
    """Proposes the output that decoding without drafts gave (found by prompt), with
    every fifth position wrong: drafts both accepted and rejected, on a random model."""

    def __init__(self, reference: dict[tuple, list[int]]) -> None:
        self.reference = reference

    def propose(self, requests, num_tokens):
        out = []
        for request, k in zip(requests, num_tokens, strict=True):
            want = self.reference[tuple(request.prompt_token_ids)]
            n = request.num_output_tokens
            out.append([t + (i % 5 == 3) for i, t in enumerate(want[n : n + k], start=n)])
        return out


def _run(path, prompts, params, oracle=None, **options):
    llm = LLM(str(path), **{**SMALL, **options})
    core = llm.engine.core
    if oracle is not None:
        core.speculator.proposer = Oracle(oracle)
    outs = llm.generate(prompts, params)
    assert core.kv_cache.check_integrity()
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
    return outs, core


def _assert_same(want, got, tol: float = 1e-5) -> None:
    for w, g in zip(want, got, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
        for a, b in zip(w.outputs[0].logprobs or [], g.outputs[0].logprobs or [], strict=True):
            assert list(b) == list(a)
            assert list(b.values()) == pytest.approx(list(a.values()), abs=tol)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"max_num_batched_tokens": 16},  # chunked prefill
        {"kv_cache_memory": 1 << 16, "max_model_len": 128},  # preemption
        {"num_speculative_tokens": 7, "speculative_adaptive": False},
    ],
)
def test_greedy_output_with_drafts_equals_decoding_without(tiny_checkpoint, options):
    path = tiny_checkpoint("llama")
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=45, repetition_penalty=1.3),
        SamplingParams(temperature=0.0, max_tokens=50, min_tokens=40, presence_penalty=0.5),
        SamplingParams(temperature=0.0, max_tokens=33),
    ]
    want, plain = _run(path, prompts, params, **options)
    spec = {**options, "speculative_method": "ngram"}
    # the ngram proposer (prompt lookup of single tokens: drafts, seldom right here)
    got, core = _run(path, prompts, params, prompt_lookup_min=1, **spec)
    _assert_same(want, got)
    assert core.stats().spec_decode["num_drafts"] > 5
    # drafts that are mostly right
    reference = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want, strict=True)}
    got, core = _run(path, prompts, params, oracle=reference, **spec)
    _assert_same(want, got)
    stats = core.stats().spec_decode
    assert stats["num_accepted_tokens"] > 40, stats
    assert stats["num_accepted_tokens"] < stats["num_draft_tokens"]
    assert core.stats().num_steps < plain.stats().num_steps
    if "max_model_len" in options:
        assert core.scheduler.num_preemptions > 0


@pytest.mark.skipif(not cpu_has_bf16(), reason="needs AMX or AVX-512 BF16")
def test_bf16_precision_verifies_drafts_as_its_decodes_run(tiny_checkpoint):
    """matmul_precision bf16 runs steps of 16+ rows in bf16; 6 sequences with 4 drafts
    each are 30 rows, verified in fp32 as their 6 decodes would be: the same tokens."""
    path = tiny_checkpoint("llama")
    prompts = _prompts() + [p[::-1] for p in _prompts()[:2]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want, _ = _run(path, prompts, params, matmul_precision="bf16")
    reference = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want, strict=True)}
    options = {"speculative_method": "ngram", "speculative_adaptive": False}
    got, core = _run(path, prompts, params, reference, matmul_precision="bf16", **options)
    _assert_same(want, got)
    assert core.runner.bf16_prefill and core.stats().spec_decode["num_accepted_tokens"] > 100


@pytest.mark.parametrize("draft", ["llama", "qwen2"])  # itself: drafts right; another: not
@pytest.mark.parametrize(
    "options",
    [{}, {"max_num_batched_tokens": 16, "kv_cache_memory": 1 << 16, "max_model_len": 128}],
)
def test_a_draft_model_proposes_and_greedy_output_is_unchanged(tiny_checkpoint, draft, options):
    path = tiny_checkpoint("llama")
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.2),
        SamplingParams(temperature=0.8, max_tokens=30, seed=5),  # random: drawn alike
        SamplingParams(temperature=0.0, max_tokens=45, ignore_eos=True),
    ]
    want, plain = _run(path, prompts, params, **options)
    spec = {"speculative_method": "draft", "speculative_model": str(tiny_checkpoint(draft))}
    got, core = _run(path, prompts, params, **spec, **options)
    _assert_same(want, got)
    stats = core.stats().spec_decode
    assert stats["num_drafts"] > 10
    proposer = core.speculator.proposer
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks  # every mirror freed
    if draft == "llama":  # the same model: its drafts are the target's own greedy tokens
        assert stats["acceptance_rate"] > 0.6 and core.stats().num_steps < plain.stats().num_steps
    if "max_model_len" in options:
        assert core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("draft", ["llama", "qwen2"])
def test_a_draft_models_lag_is_the_catch_up_it_then_runs(tiny_checkpoint, draft):
    path, other = str(tiny_checkpoint("llama")), str(tiny_checkpoint(draft))
    llm = LLM(path, **SMALL, enable_prefix_caching=False, speculative_method="draft",
              speculative_model=other)  # fmt: skip
    proposer = llm.engine.core.speculator.proposer
    propose, execute = proposer.propose, proposer.runner.execute
    seen = []  # per call: each request's lag before it, and the rows of its first pass

    def recorded(requests, num_tokens):
        lags = {
            r.request_id: proposer.lag(r) for r, k in zip(requests, num_tokens, strict=True) if k
        }
        passes = []

        def run(out):
            passes.append({s.request.request_id: s.num_new_tokens for s in out.scheduled})
            return execute(out)

        proposer.runner.execute = run
        drafts = propose(requests, num_tokens)
        proposer.runner.execute = execute
        seen.append((lags, passes[0]))
        return drafts

    proposer.propose = recorded
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm.generate(prompts, params)
    assert seen and all(lags == first for lags, first in seen)
    firsts = [lag for lags, _ in seen for lag in lags.values()]
    assert {len(p) + 1 for p in prompts} <= set(firsts)  # prompt and first token, at first
    stats = llm.engine.core.stats().spec_decode  # llama: drafts kept; qwen2: rejected
    kept = stats["num_accepted_tokens"]
    assert kept > 0 if draft == "llama" else kept < stats["num_draft_tokens"]
    assert proposer.lag(Request("new", [1, 2, 3], params, 10)) == 3


def test_the_draft_model_finds_an_earlier_turns_kv_by_prefix(tiny_checkpoint):
    path = str(tiny_checkpoint("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    llm = LLM(path, **SMALL, speculative_method="draft", speculative_model=path)
    proposer = llm.engine.core.speculator.proposer
    first = _prompts()[2]
    reply = llm.generate([first], params)[0].outputs[0].token_ids
    computed = proposer.num_rows
    assert computed >= len(first)
    # the next turn: the first turn's prompt and reply, and a new message; 3 tokens: the
    # draft model catches up once, after the first, and proposes one
    second = first + reply + _prompts()[1][:10]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    got = llm.generate([second], params)[0].outputs[0].token_ids
    assert len(second) == 80 and proposer.num_rows - computed == 81 - 64  # 4 blocks
    assert got == LLM(path, **SMALL).generate([second], params)[0].outputs[0].token_ids
    assert proposer.kv.check_integrity()
    assert proposer.kv.num_free_blocks == proposer.kv.num_blocks


def test_a_draft_model_must_share_the_vocabulary(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from conftest import COMMON

    other = tmp_path / "other"
    config = LlamaConfig(**{**COMMON, "vocab_size": 600})
    AutoModelForCausalLM.from_config(config).save_pretrained(other)
    with pytest.raises(ValueError, match="speculative_model: its vocabulary has 600"):
        LLM(str(tiny_checkpoint("llama")), **SMALL, speculative_method="draft",
            speculative_model=str(other))  # fmt: skip
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="draft")
    with pytest.raises(ValueError, match="speculative_model"):
        EngineConfig(speculative_method="ngram", speculative_model="x")


def test_prefix_hits_and_stop_strings_beside_drafts(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    prompts = _prompts()
    params = [
        SamplingParams(temperature=0.0, max_tokens=60, stop=["e", " the"]),
        SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[7, 9]),
        SamplingParams(temperature=0.0, max_tokens=40, stop=["unicode"], ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=40, seed=3),  # drafts, random
    ]
    llm_plain = LLM(str(path), **SMALL)
    llm_spec = LLM(str(path), **SMALL, speculative_method="ngram")
    for _ in range(2):  # the second time from the prefix cache
        want = llm_plain.generate(prompts, params)
        # drafts mostly right: several tokens a step, a stop string ends inside them
        reference = {tuple(p): w.outputs[0].token_ids for p, w in zip(prompts, want, strict=True)}
        llm_spec.engine.core.speculator.proposer = Oracle(reference)
        got = llm_spec.generate(prompts, params)
        for w, g in list(zip(want, got, strict=True))[:3]:
            assert (g.outputs[0].text, g.outputs[0].token_ids) == (
                w.outputs[0].text,
                w.outputs[0].token_ids,
            )
            assert g.outputs[0].finish_reason == w.outputs[0].finish_reason
            assert g.outputs[0].stop_reason == w.outputs[0].stop_reason
    assert got[2].outputs[0].stop_reason == "unicode"
    assert got[0].num_cached_tokens > 0
    core = llm_spec.engine.core
    assert core.stats().spec_decode["num_accepted_tokens"] > 20
    assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks


def test_grammar_requests_verify_drafts_the_grammar_takes(tiny_checkpoint):
    """JSON-constrained requests beside an unconstrained one: drafts mostly right, some
    that break the grammar (cut before verification) or the model's choice (rejected)."""

    def run(reference=None, **options) -> tuple[dict[str, list[int]], EngineCore]:
        config = EngineConfig(model=str(tiny_checkpoint("llama")), **SMALL, **options)
        core = EngineCore.from_config(config)
        if reference is not None:
            core.speculator.proposer = Oracle(reference)
        properties = {"name": {"type": "string"}, "items": {"type": "array"}}
        schema = {"type": "object", "properties": properties, "required": ["name", "items"]}
        grammar = json_schema_grammar(schema)
        for i, prompt in enumerate(_prompts()):
            params = SamplingParams(temperature=0.0, max_tokens=40)
            core.add_request(
                EngineCoreRequest(f"r{i}", prompt, params, 40, [1], grammar=grammar if i else None)
            )
        out: dict[str, list[int]] = {}
        while core.has_unfinished():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        assert core.kv_cache.num_free_blocks == core.kv_cache.num_blocks
        return out, core

    want, _ = run()
    reference = {tuple(p): want[f"r{i}"] for i, p in enumerate(_prompts())}
    got, core = run(reference, speculative_method="ngram", speculative_adaptive=False)
    assert got == want
    assert all(len(want[f"r{i}"]) == 40 for i in range(1, 4))  # JSON of some length
    assert core.stats().spec_decode["num_accepted_tokens"] > 60


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_a_seeded_random_request_gives_the_same_tokens_with_drafts_as_without(
    tiny_checkpoint, method
):
    path = str(tiny_checkpoint("llama"))
    prompts = _prompts()
    params = [SamplingParams(temperature=t, top_p=0.9, max_tokens=40, seed=11 + i)
              for i, t in enumerate([0.7, 1.0, 1.3, 0.5])]  # fmt: skip
    want = [o.outputs[0].token_ids for o in LLM(path, **SMALL).generate(prompts, params)]
    # the draft model is the target itself: drawing with the target's noise, its drafts
    # are the target's draws (greedy drafts would be kept as often as p(argmax))
    spec = {"speculative_method": method, "prompt_lookup_min": 1, "speculative_model": path}
    llm = LLM(path, **SMALL, **spec if method == "draft" else {**spec, "speculative_model": None})
    for _ in range(2):
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert got == want
    stats = llm.engine.core.stats().spec_decode
    assert stats["num_drafts"] > 0
    if method == "draft":
        assert stats["acceptance_rate"] > 0.9, stats


def test_bad_speculative_options_are_refused_by_name():
    with pytest.raises(ValueError, match="speculative_method"):
        EngineConfig(speculative_method="eagle")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(num_speculative_tokens=0)
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        EngineConfig(prompt_lookup_min=4, prompt_lookup_max=2)


# -- served ---------------------------------------------------------------------------------


def test_a_speculating_server_answers_as_one_without_and_reports_its_drafts(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    kv = ["--kv-cache-memory", "16M", "--max-model-len", "512"]
    spec = ["--speculative-method", "ngram", "--prompt-lookup-min", "1"]
    plain = EmberServer(model, *kv)
    try:
        server = EmberServer(model, *kv, *spec, "--no-speculative-adaptive")
        try:
            for prompt in (CORPUS[0] + CORPUS[2], CORPUS[3] + CORPUS[4]):
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": 40,
                    "temperature": 0,
                    "logprobs": True,
                    "top_logprobs": 2,
                }
                want = httpx.post(f"{plain.url}/v1/chat/completions", json=body, timeout=60)
                got = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
                assert got.status_code == 200
                assert got.json()["choices"] == want.json()["choices"]
                assert got.json()["usage"] == want.json()["usage"]
            load = server.wait_idle()
            assert load["spec_decode"]["num_drafts"] > 0
            assert plain.load()["spec_decode"] is None
            metrics = httpx.get(f"{server.url}/metrics", timeout=5).text
            drafted = load["spec_decode"]["num_draft_tokens"]
            assert f'ember_spec_decode_tokens{{kind="draft",model_name="{model}"}} {drafted}.0' in (
                metrics
            )
        finally:
            assert server.stop() == 0
    finally:
        plain.stop()


def test_ember_bench_reports_what_the_runs_drafts_did():
    from ember.bench.commands import spec_summary

    before = {"num_drafts": 10, "num_draft_tokens": 30, "num_accepted_tokens": 12}
    before["accepted_per_position"] = [8, 4]
    after = {"num_drafts": 30, "num_draft_tokens": 90, "num_accepted_tokens": 42}
    after["accepted_per_position"] = [20, 14, 8]
    summary = spec_summary(before, after)
    assert summary["accepted_per_position"] == [12, 10, 8]
    assert (summary["num_drafts"], summary["num_draft_tokens"]) == (20, 60)
    assert summary["acceptance_rate"] == 0.5 and summary["mean_accepted_length"] == 2.5
    assert spec_summary(None, None) is None
    assert spec_summary(None, after)["num_accepted_tokens"] == 42

"""Turning a batch of logits into one token per sequence.

Order of operations per row: the request's logit bias, penalties (repetition over prompt
and output, presence and frequency over output), the grammar mask of a constrained
request, the min_tokens mask (EOS and stop token ids, while the output is shorter; never
the last token a grammar allows), then greedy argmax or temperature -> top-k -> top-p ->
min-p -> a draw. Draws use the exponential race (argmax of p / E, E ~ Exp(1)), which
samples from p exactly. The noise E of a request's draw at token position n is seeded by
the request's seed (its own, or one drawn for it when it came) and n alone
(`position_noise`), so the token at a position depends on nothing but the tokens before
it: not on the batch, nor on how steps grouped its tokens (drafts verified together,
a preemption, a prefill on another worker).

Log-probabilities returned are the model's own (log-softmax of the raw logits).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ember.engine.grammar_masks import apply_grammars
from ember.engine.kernels import built_cpu_kernels
from ember.engine.request import Request


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: {token id: logprob} with the sampled token first, then the top-n; or None
    logprobs: list[dict[int, float] | None]


class Sampler:
    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = _raw_logprobs(logits, requests)
        logits = process_logits(logits, requests)
        tokens = argmax_rows(logits)
        random_rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, device=logits.device)
            subset = [requests[i] for i in random_rows]
            tokens[rows] = sample_random(logits[rows], subset)
        token_list = tokens.tolist()
        return SamplerOutput(token_list, _gather_logprobs(raw_logprobs, token_list, requests))

    def verify(
        self, logits: torch.Tensor, requests: list[Request], drafts: list[list[int]]
    ) -> tuple[list[list[int]], list[list[dict[int, float]] | None]]:
        """Speculative decoding: each request's rows (1 + its drafts, one after another in
        `logits`) give its tokens: the drafts the target model accepts, then one of its
        own (a correction where a draft is rejected, else the token after the last).

        Row i of a request is processed as if its first i drafts were output already
        (penalties, min_tokens). Greedy: a draft is accepted while it equals the row's
        argmax. Random: a draft is accepted while it equals the row's own draw, with the
        noise of that row's position. Either way the output is what decoding without
        drafts gives, token for token, so its distribution is the model's exactly. (A
        draft that does not depend on the row's noise is kept with probability p(draft),
        as Leviathan et al.'s rejection sampling keeps it; a draft model drawing with
        the same noise from its own distribution q is kept more often the nearer q is
        to p.) Returns (tokens, logprobs: an entry per token, or None) per request."""
        rows = []
        for request, draft in zip(requests, drafts, strict=True):
            grammar = request.grammar
            masks = grammar.masks_along(draft) if grammar is not None and draft else None
            for i in range(len(draft) + 1):
                rows.append(_Row(request, draft[:i], None if masks is None else _Mask(masks[i])))
        logits = logits.float()
        raw_logprobs = _raw_logprobs(logits, rows)
        logits = process_logits(logits, rows)
        targets = argmax_rows(logits).tolist()
        tokens, logprobs, first = [], [], 0
        for request, draft in zip(requests, drafts, strict=True):
            span = range(first, first + len(draft) + 1)
            if request.sampling_params.greedy:
                accepted = _accept_greedy(draft, [targets[i] for i in span])
            else:
                probs = random_probs(logits[span.start : span.stop], [request] * len(span))
                accepted = _accept_drawn(draft, probs, request)
            tokens.append(accepted)
            logprobs.append(
                None
                if raw_logprobs is None or request.sampling_params.logprobs is None
                else [
                    _logprob_entry(raw_logprobs[span[i]], t, request.sampling_params.logprobs)
                    for i, t in enumerate(accepted)
                ]
            )
            first = span.stop
        return tokens, logprobs


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, a NaN's index where a row has one), as
    `argmax(dim=-1)` gives it: on CPU float32 rows ember's kernel (`argmax_rows`: 7 and 28
    us for 1 and 8 rows of SmolLM2's 49,152 logits on a 2-core Zen 5, against 27 and 124
    for torch's max with indices), else from `max`'s indices (29 against 66 us for one row
    in `argmax`, 93 against 268 for 8 rows: a 2-thread AMX Xeon)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2:
        kernels = built_cpu_kernels()
        if kernels is not None and logits.shape[1] > 0 and logits.stride(1) == 1:
            return kernels.argmax_rows(logits)
    return logits.max(dim=-1).indices


class _Row:
    """A request as one of its verification rows sees it: with the drafts before the row
    output already (what penalties, min_tokens, logit bias and grammars read); `mask`: a
    grammar's mask in that state."""

    def __init__(self, request: Request, drafts: list[int], mask: _Mask | None = None) -> None:
        self.request, self.drafts = request, drafts
        self.sampling_params = request.sampling_params
        self.grammar = mask or request.grammar  # undrafted requests: the matcher as it is

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids + self.drafts

    @property
    def output_token_ids(self) -> list[int]:
        return self.request.output_token_ids + self.drafts

    @property
    def num_output_tokens(self) -> int:
        return self.request.num_output_tokens + len(self.drafts)

    @property
    def ending_token_ids(self) -> set[int]:
        return self.request.ending_token_ids


class _Mask:
    """A grammar mask computed ahead (GrammarMatcher.masks_along), as apply_grammars asks."""

    def __init__(self, mask: torch.Tensor) -> None:
        self._mask = mask

    def allowed(self) -> torch.Tensor:
        return self._mask


def _accept_greedy(draft: list[int], targets: list[int]) -> list[int]:
    """The drafts equal to the target's argmax at their row, then the target's token."""
    for i, token in enumerate(draft):
        if token != targets[i]:
            return [*draft[:i], targets[i]]
    return [*draft, targets[len(draft)]]


def _accept_drawn(draft: list[int], probs: torch.Tensor, request: Request) -> list[int]:
    """The drafts equal to the row's own draw (the noise of its position), then that
    draw; rows past the first draft that differs are not drawn."""
    for i in range(len(draft) + 1):
        noise = position_noise(request.seed, request.num_tokens + i, probs.shape[-1], probs.device)
        token = int((probs[i] / noise).argmax())
        if i == len(draft) or token != draft[i]:
            return [*draft[:i], token]
    raise AssertionError("unreachable")


def position_noise(seed: int, position: int, size: int, device=None) -> torch.Tensor:
    """Exp(1) noise of a draw at token `position` by a request seeded `seed`, made on
    `device` (its generator's: the same numbers on every device of a kind)."""
    generator = torch.Generator(device=device or "cpu").manual_seed(_mix(seed, position))
    return torch.empty(size, device=device).exponential_(generator=generator)


def _mix(seed: int, position: int) -> int:
    """A 63-bit seed from (seed, position), well spread (SplitMix64's finalizer)."""
    mask = (1 << 64) - 1
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1


def _raw_logprobs(logits: torch.Tensor, requests) -> torch.Tensor | None:
    if any(r.sampling_params.logprobs is not None for r in requests):
        return torch.log_softmax(logits, dim=-1)
    return None


def process_logits(logits: torch.Tensor, requests) -> torch.Tensor:
    """Logit bias, penalties, grammar masks and min_tokens, in that order, per row."""
    if any(r.sampling_params.logit_bias for r in requests):
        logits = apply_logit_bias(logits, requests)
    if any(r.sampling_params.has_penalties for r in requests):
        logits = apply_penalties(logits, requests)
    logits = apply_grammars(logits, requests)
    if any(r.num_output_tokens < r.sampling_params.min_tokens for r in requests):
        logits = apply_min_tokens(logits, requests)
    return logits


def apply_logit_bias(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Adds each row's `logit_bias` (token id -> bias) to its logits."""
    rows, cols, values = [], [], []
    for i, request in enumerate(requests):
        bias = request.sampling_params.logit_bias or {}
        rows += [i] * len(bias)
        cols += bias.keys()
        values += bias.values()
    index = _index(rows, cols, logits.device)
    bias_values = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    return logits.index_put(index, bias_values, accumulate=True)


def apply_min_tokens(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Masks the tokens that would end a row whose output is still shorter than its
    min_tokens; a row left with no token at all (a grammar that can only end) keeps its
    logits."""
    rows, cols = [], []
    for i, request in enumerate(requests):
        if request.num_output_tokens < request.sampling_params.min_tokens:
            ending = request.ending_token_ids
            rows += [i] * len(ending)
            cols += ending
    index = _index(rows, cols, logits.device)
    masked = logits.index_put(index, torch.tensor(float("-inf"), device=logits.device))
    alive = torch.isfinite(masked).any(dim=-1, keepdim=True)
    return torch.where(alive, masked, logits)


def _index(rows: list[int], cols: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row, column) index tensors for `index_put` (long, also when empty)."""
    return (
        torch.tensor(rows, dtype=torch.long, device=device),
        torch.tensor(cols, dtype=torch.long, device=device),
    )


def apply_penalties(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """OpenAI presence/frequency penalties on output tokens, HF repetition penalty on all."""
    num_rows, vocab = logits.shape
    device = logits.device
    output_counts = _token_counts([r.output_token_ids for r in requests], vocab, device)
    seen = _token_counts([r.token_ids for r in requests], vocab, device) > 0
    params = [r.sampling_params for r in requests]
    presence = torch.tensor([p.presence_penalty for p in params], device=device).unsqueeze(1)
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device).unsqueeze(1)
    repetition = torch.tensor([p.repetition_penalty for p in params], device=device).unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    return logits - frequency * output_counts - presence * (output_counts > 0)


def _token_counts(token_lists: list[list[int]], vocab: int, device) -> torch.Tensor:
    width = max((len(t) for t in token_lists), default=0)
    padded = torch.full((len(token_lists), width), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        padded[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    padded = padded.to(device)
    counts = torch.zeros(len(token_lists), vocab + 1, device=device)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=counts.dtype))
    return counts[:, :vocab]


def sample_random(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Draws one token per row after temperature, top-k, top-p and min-p."""
    probs = random_probs(logits, requests)
    size, device = probs.shape[1], probs.device
    noise = torch.stack([position_noise(r.seed, r.num_tokens, size, device) for r in requests])
    return argmax_rows(probs / noise)


def random_probs(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Each row's distribution after temperature, top-k, top-p and min-p (min-p's rows
    are not renormalized: a draw from them need not be)."""
    device = logits.device
    params = [r.sampling_params for r in requests]
    temperature = torch.tensor([p.temperature for p in params], device=device).unsqueeze(1)
    logits = logits / temperature
    top_k = [p.top_k for p in params]
    top_p = [p.top_p for p in params]
    if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, top_k, top_p)
    probs = torch.softmax(logits, dim=-1)
    min_p = torch.tensor([p.min_p for p in params], device=device).unsqueeze(1)
    if bool((min_p > 0).any()):
        probs = torch.where(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0, probs)
    return probs


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Masks (to -inf) tokens outside each row's top-k and top-p nucleus."""
    device = logits.device
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    k = torch.tensor([kk if kk > 0 else vocab for kk in top_k], device=device).unsqueeze(1)
    drop = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of strictly better tokens
    p = torch.tensor(top_p, device=device).unsqueeze(1)
    drop |= mass_before >= p  # the top token always stays (mass_before is 0)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _gather_logprobs(
    raw: torch.Tensor | None, tokens: list[int], requests: list[Request]
) -> list[dict[int, float] | None]:
    if raw is None:
        return [None] * len(requests)
    out: list[dict[int, float] | None] = []
    for i, request in enumerate(requests):
        num = request.sampling_params.logprobs
        out.append(None if num is None else _logprob_entry(raw[i], tokens[i], num))
    return out


def _logprob_entry(raw: torch.Tensor, token: int, num: int) -> dict[int, float]:
    """{token: its logprob} followed by the row's top `num`."""
    entry = {token: float(raw[token])}
    if num:
        values, ids = raw.topk(num)
        for top, value in zip(ids.tolist(), values.tolist(), strict=True):
            entry.setdefault(top, value)
    return entry

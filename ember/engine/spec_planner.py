"""How many drafts pay for themselves in a step (the adaptive mode's batch-aware part).

A verification row costs compute where a plain decode row costs mostly the pass over
the weights, so whether drafts pay depends on the batch, the model, the kernels and the
box. Measured on a 2-core CPU with Qwen2.5-Coder-1.5B (Q4_K): a decode step of 4
sequences took 157 ms; with 1, 2 and 4 drafts each (8, 12 and 20 rows) 232, 382 and
560 ms. One sequence with 4 drafts: 168 ms against 114. So drafts that pay at batch 1
can cost throughput at batch 4.

Each step `DraftPlanner.plan` chooses, among the drafts the per-request budgets allow,
the set that maximizes expected output tokens per millisecond (goodput):

    (B + sum of the chosen drafts' values) / (T(B, B + n) + P(passes, rows))

B: the sequences decoding; a draft at position j of a request whose drafts are each
accepted with probability a is worth a^j tokens (it counts only if all before it are
kept); T(B, r): the decode step of B sequences and r rows, measured (`DecodeCosts`);
P: the proposer's own time, fitted to its forward passes and rows. Drafts are added best
value first, so the choice is the best prefix of that order; with no prefix better than
none, the step decodes without drafts.

`DecodeCosts` keeps the measured time of each (sequences, rows) seen in decode-only
steps; one not seen yet is interpolated between the nearest seen ones of the same
sequences, or extended from them (beyond the last, by the slope between the last two;
from a single one, by the cost of a row more measured at the nearest other batch size,
or the engine's linear `StepCostModel`'s), or taken from that model. The plan tries
what its estimate favours, and what it tries is measured, so wrong estimates are
corrected by the next step that uses them; it reaches at most one draft per sequence
past the most rows measured at the batch size, so that a wrong estimate costs little
(4 drafts each at once, on the numbers above, cost as much as 3.6 plain steps). The
step without drafts, the rate every plan is measured against, is measured first: a
batch size never seen decoding without drafts decodes one step without them.

A proposer that runs a model first catches up over every token of a request it has not
computed (`Proposer.lag`: a draft model's, the whole context the first time it drafts
for the request, then what the target decoded while it did not draft). That catch-up
is an investment: once made, the request drafts at the price of its drafts alone for
the rest of its reply. So the plan charges a request's first draft with its catch-up
rows spread over the steps it is expected to decode still (the tokens it has left,
under its `max_tokens` and as long as recent replies ran, over the tokens a step of
its drafts yields).

Requests left without drafts keep their acceptance estimate; after `PROBE_EVERY` steps
that left some out, those get one draft, so that an estimate that has gone stale (a
reply that turned from prose to quoting its context) comes back; each probe doubles the
wait (up to `PROBE_MAX`), and the wait is stretched by what the last probe's proposing
cost in decode steps; a plan that leaves none out resets it. A probe is for learning,
not for its tokens, so only requests whose whole catch-up costs at most `PROBE_COST` of
a decode step are probed (measured with a 0.5B draft model for a 1.5B target on two
cores: probes that caught up over ~150 tokens of three replies cost 850 ms, six
steps, and at 4 sequences at once such probes were most of what the draft model lost).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np

from ember.engine.step_cost import FadingLeastSquares, StepCostModel, StepShape

PROBE_EVERY = 32  # steps that left a request's drafts out, then one draft each
PROBE_MAX = 256  # the wait doubles at each probe, up to this (back to PROBE_EVERY when
# a plan leaves no request out)
PROBE_COST = 0.5  # a request is probed when its catch-up costs at most this many steps
MARGIN = 0.02  # a plan with drafts must beat none by this share (noise)


class DecodeCosts:
    """Measured milliseconds of decode-only steps by (sequences, rows)."""

    def __init__(self, fallback: StepCostModel, smoothing: float = 0.3) -> None:
        self.fallback = fallback
        self.smoothing = smoothing  # weight of the newest measurement
        self._ms: dict[int, dict[int, float]] = {}  # sequences -> rows -> ms

    def observe(self, num_seqs: int, num_rows: int, ms: float) -> None:
        if not np.isfinite(ms) or ms < 0:
            return
        seen = self._ms.setdefault(num_seqs, {})
        old = seen.get(num_rows)
        seen[num_rows] = ms if old is None else old + self.smoothing * (ms - old)

    def seen(self, num_seqs: int, num_rows: int) -> bool:
        return num_rows in self._ms.get(num_seqs, {})

    def most_rows(self, num_seqs: int) -> int:
        """The most rows measured in a step of `num_seqs` sequences (0: none yet)."""
        return max(self._ms.get(num_seqs, {0: 0.0}))

    def predict(self, num_seqs: int, num_rows: int) -> float:
        seen = self._ms.get(num_seqs)
        if not seen:
            return self.fallback.predict_ms(StepShape(num_decode_rows=num_rows))
        if (ms := seen.get(num_rows)) is not None:
            return ms
        below = [r for r in seen if r < num_rows]
        above = [r for r in seen if r > num_rows]
        if below and above:
            lo, hi = max(below), min(above)
        else:  # extended from the two nearest (or the linear model's cost per row)
            near = sorted(below or above, key=lambda r: abs(r - num_rows))[:2]
            if len(near) == 1:
                slope = self._row_slope(num_seqs)
                return max(seen[near[0]] + slope * (num_rows - near[0]), 0.0)
            lo, hi = sorted(near)
        slope = (seen[hi] - seen[lo]) / (hi - lo)
        return max(seen[lo] + slope * (num_rows - lo), 0.0)

    def _row_slope(self, num_seqs: int) -> float:
        """The cost of a row more in a step of `num_seqs` sequences, measured at least
        twice only at other batch sizes: the slope over the first rows past their plain
        step at the nearest such batch size (a verification row's cost is arithmetic,
        much alike at any batch size), else the linear model's cost per decode row."""
        others = [b for b, seen in self._ms.items() if len(seen) > 1 and b != num_seqs]
        if not others:
            return self.fallback.coefficients[2]
        seen = self._ms[min(others, key=lambda b: (abs(b - num_seqs), b))]
        lo, hi = sorted(seen)[:2]
        return max((seen[hi] - seen[lo]) / (hi - lo), 0.0)


class DraftPlanner:
    """Chooses each step's drafts by goodput (module docstring)."""

    def __init__(self, step_cost: StepCostModel) -> None:
        self.decode_costs = DecodeCosts(step_cost)
        # the proposer's milliseconds ~ per call + per forward pass + per row computed
        self.propose_cost = FadingLeastSquares(
            np.zeros(3), np.array([1.0, 4.0, 16.0]), prior_weight=1.0, decay=0.95
        )
        self.probe_every = PROBE_EVERY
        self._left_out = 0  # steps that left some request's drafts out, since a probe
        self._probe_scale = 1.0  # the last probe's proposing, in decode steps (>= 1)
        self._probe_step_ms: float | None = None  # a probe's step without drafts, until
        # its proposing is timed

    def plan(
        self,
        num_decoding: int,
        caps: Sequence[int],
        acceptance: Sequence[float],
        lags: Sequence[int] | None = None,
        tokens_left: Sequence[float] | None = None,
    ) -> list[int]:
        """Drafts for each of the requests that may draft (at most `caps[i]`, accepted
        with probability `acceptance[i]` each), in a step where `num_decoding`
        sequences decode; the proposer first catches up over `lags[i]` tokens of a
        request, which is expected to decode `tokens_left[i]` tokens more."""
        b = num_decoding
        if not self.decode_costs.seen(b, b):  # first the rate to beat
            return [0] * len(caps)
        lags = lags or [0] * len(caps)
        tokens_left = tokens_left or [float(cap) for cap in caps]
        reach = self.decode_costs.most_rows(b)  # then one draft each past it, at most
        base_ms = self.decode_costs.predict(b, b)
        best_rate = b / max(base_ms, 1e-6)
        threshold = best_rate * (1 + MARGIN)
        # the drafts best value first: each request's next one, a^(j+1) after a^j
        heap = [(-a, i) for i, (cap, a) in enumerate(zip(caps, acceptance, strict=True)) if cap]
        heapq.heapify(heap)
        counts, ks = [0] * len(caps), [0] * len(caps)
        gained = passes = proposed_rows = 0.0
        for n in range(1, reach + 1):
            if not heap:
                break
            value, i = heapq.heappop(heap)
            value = -value
            counts[i] += 1
            if counts[i] < caps[i]:
                heapq.heappush(heap, (-value * acceptance[i], i))
            if counts[i] == 1 and lags[i]:
                # its catch-up, spread over its steps left (each yields what its drafts keep)
                per_step = 1 + _kept(acceptance[i], caps[i])
                proposed_rows += lags[i] * per_step / max(tokens_left[i], per_step)
            passes = max(passes, counts[i])
            gained += value
            proposed_rows += 1 + value  # a draft's row, and the catch-up of what is kept
            ms = self.decode_costs.predict(b, b + n) + self.propose_cost.predict(
                np.array([1.0, passes, proposed_rows])
            )
            rate = (b + gained) / max(ms, 1e-6)
            if rate > max(best_rate, threshold):
                best_rate, ks = rate, counts.copy()
        if all(ks):
            self.probe_every = PROBE_EVERY
            return ks
        self._left_out += 1
        if self._left_out >= self.probe_every * self._probe_scale:
            self._left_out = 0
            probed = [
                k or int(self._catch_up_ms(lag) <= PROBE_COST * base_ms)
                for k, lag in zip(ks, lags, strict=True)
            ]
            if probed != ks:
                self.probe_every = min(2 * self.probe_every, PROBE_MAX)
                self._probe_step_ms = base_ms
                ks = probed
        return ks

    def _catch_up_ms(self, lag: int) -> float:
        """The proposer's predicted time for a pass over `lag` tokens and one draft."""
        return self.propose_cost.predict(np.array([1.0, 1.0, lag + 1.0]))

    def observe_proposal(self, num_passes: int, num_rows: int, ms: float) -> None:
        """The proposer's time for a call that ran `num_passes` forward passes over
        `num_rows` rows in all."""
        self.propose_cost.observe(np.array([1.0, num_passes, num_rows]), ms)
        if self._probe_step_ms is not None:
            self._probe_scale = max(ms / max(self._probe_step_ms, 1e-6), 1.0)
            self._probe_step_ms = None

    def observe_step(self, shape: StepShape, num_seqs: int, ms: float) -> None:
        """A step's measured time (decode-only steps are kept)."""
        if shape.num_prefill_tokens == 0:
            self.decode_costs.observe(num_seqs, shape.num_decode_rows, ms)


def _kept(acceptance: float, num_drafts: int) -> float:
    """The expected drafts kept of `num_drafts`, each accepted with `acceptance` given
    those before it were."""
    return sum(acceptance**j for j in range(1, num_drafts + 1))

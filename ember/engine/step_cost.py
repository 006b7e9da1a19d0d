"""What one engine step costs, learned online from the steps the engine times.

    step_ms ~= base + per_prefill_token * P + per_decode_row * D + per_attention * A

P: tokens of the step's prefill chunks (requests computing more than one token),
D: requests computing one token (decodes), A: query-key pairs the prefill chunks attend,
in thousands (a chunk of n tokens after c computed ones attends n * (c + n / 2)).

Life cycle: the engine core makes one `StepCostModel` per engine (so per model and
device); the scheduler asks `max_prefill_tokens` before it plans a step that has decodes
to keep fast; the core times the step and calls `observe(shape, ms)`. The fit is
least squares over exponentially fading sums (recent steps count most, so the model
follows a box whose speed changes; only steps with prefill fade the others, see
`StepCostModel.observe`). The prior enters as `prior_weight` typical steps
seen before the first, fading at every step seen, plus a faint lasting pull: where the steps
seen say nothing about a coefficient (no prefill yet, say) the prior holds it, so the
first steps are planned with the prior's (conservative) costs. Coefficients are fitted
under the constraint >= 0 (`nonnegative_solve`), so predictions never fall as work is
added.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class StepShape:
    """The work of one step, as the cost model sees it."""

    num_prefill_tokens: int = 0
    num_decode_rows: int = 0
    num_attention_pairs: float = 0.0  # thousands of (query, key) pairs in prefill chunks

    @staticmethod
    def chunk_pairs(num_computed: int, num_new: int) -> float:
        return num_new * (num_computed + num_new / 2) / 1000

    def features(self) -> np.ndarray:
        return np.array(
            [1.0, self.num_prefill_tokens, self.num_decode_rows, self.num_attention_pairs]
        )


ATTENTION = 3  # the attention pairs' place in StepShape.features and the coefficients


@dataclass(frozen=True)
class StepCoefficients:
    """Milliseconds: per step, per prefill token, per decode row, per 1000 attention pairs.

    The defaults are a conservative prior for a small model on a slow CPU (SmolLM2-135M in
    fp32 on 2 Xeon cores: ~50 ms a decode step, ~1.5 ms a prefill token); the engine
    learns its own within a few steps (the prior is worth PRIOR_WEIGHT of them)."""

    base: float = 60.0
    per_prefill_token: float = 2.0
    per_decode_row: float = 2.0
    per_attention: float = 0.02

    def as_array(self) -> np.ndarray:
        return np.array(
            [self.base, self.per_prefill_token, self.per_decode_row, self.per_attention]
        )


# a typical size of each feature, so that the prior's pull is alike on every coefficient
_TYPICAL = np.array([1.0, 256.0, 8.0, 64.0])


class FadingLeastSquares:
    """y ~= x . coefficients, fitted by least squares over exponentially fading sums (each
    observation's weight is multiplied by `decay` at every later one that fades), coefficients
    kept >= 0 (`nonnegative_solve`). The prior enters as `prior_weight` observations of size `typical`
    per feature, fading at every observation, plus a faint lasting pull that holds coefficients
    the observations say nothing about."""

    def __init__(
        self, prior: np.ndarray, typical: np.ndarray, prior_weight: float, decay: float
    ) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.prior = np.asarray(prior, dtype=float)
        self.decay = decay
        ridge = np.diag(prior_weight * np.asarray(typical, dtype=float) ** 2)
        n = len(self.prior)
        self._xx, self._xy = np.zeros((n, n)), np.zeros(n)  # faded sums of x x^T and x y
        self._ridge = ridge  # the prior's observations, faded at every one seen
        self._lasting = 1e-3 * ridge
        self.coefficients = self.prior.copy()
        self.num_observed = 0

    def predict(self, x: np.ndarray) -> float:
        return float(x @ self.coefficients)

    def observe(self, x: np.ndarray, y: float, fade: bool = True) -> None:
        """Learns from one observation (a negative or non-finite y is ignored); `fade`:
        whether the earlier ones fade by `decay` first (the prior's fade either way)."""
        if not np.isfinite(y) or y < 0:
            return
        decay = self.decay if fade else 1.0
        self._xx = decay * self._xx + np.outer(x, x)
        self._xy = decay * self._xy + x * y
        self._ridge = self.decay * self._ridge
        self._refit()
        self.num_observed += 1

    def drop_prior(self, keep: tuple[int, ...] = ()) -> None:
        """Lets go of the prior (but for its faint lasting pull) on every coefficient not
        in `keep`, the observations so far having measured this machine; refits."""
        kept = np.zeros(len(self.prior))
        kept[list(keep)] = 1.0
        self._ridge = self._ridge * np.diag(kept)  # the ridge is diagonal
        self._refit()

    def _refit(self) -> None:
        pull = self._ridge + self._lasting
        self.coefficients = nonnegative_solve(self._xx + pull, self._xy + pull @ self.prior)


def nonnegative_solve(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The least-squares coefficients x >= 0 of normal equations a x = b (a positive
    definite): the most negative coefficient of the unconstrained solution is held at 0
    and the others refitted without it, until none is negative (one solve in the common
    case). Clamping the unconstrained solution instead kept the other coefficients as
    they were fitted beside the negative one: a freshly started server replaying the
    conversation trace capped its mixed steps at 230-360 prefill tokens for some sixty
    steps, each predicted at the 250 ms budget and taking 70-150 ms (simulated, the fit
    put base below 0 and the per-token cost at 2-6x the true one for 30 steps)."""
    free = list(range(len(b)))
    x = np.zeros(len(b))
    while free:
        fitted = np.linalg.solve(a[np.ix_(free, free)], b[free])
        if (fitted >= 0).all():
            x[free] = fitted
            break
        del free[int(np.argmin(fitted))]
    return x


# how many typical steps the prior is worth. At 2, a freshly started server taking 32
# streams of random 128-token prompts capped its first dozen mixed steps at 140-392
# tokens (each predicted at the 250 ms budget, taking 50-135 ms): the prior's 2 ms a
# token, 5-6x this box's, faded by ~10% a step. Replayed through the fit (the steps'
# own times): the whole 512-token chunk after 6 steps at 0.5, after 11 at 1, not in 12
# at 2 (tests/test_step_budget.py).
PRIOR_WEIGHT = 0.5


class StepCostModel:
    def __init__(
        self,
        prior: StepCoefficients | None = None,
        prior_weight: float = PRIOR_WEIGHT,
        decay: float = 0.98,
    ) -> None:
        self.fit = FadingLeastSquares(
            (prior or StepCoefficients()).as_array(), _TYPICAL, prior_weight, decay
        )

    @property
    def coefficients(self) -> np.ndarray:
        return self.fit.coefficients

    @property
    def num_observed(self) -> int:
        return self.fit.num_observed

    def predict_ms(self, shape: StepShape) -> float:
        return self.fit.predict(shape.features())

    def observe(self, shape: StepShape, measured_ms: float) -> None:
        """Learns from one step's measured time (negative or non-finite times are ignored).

        Only steps with prefill tokens fade the earlier ones: a decode-only step says
        nothing about prefill, and when every step faded the rest, a few hundred decode
        steps forgot all that prefill steps had taught, and the prior's 2 ms a prefill
        token came back (measured in agent sessions: a 192-token chunk predicted at 249
        ms took 80, and turns were cut into smaller chunks for it). Within a decode-only
        stretch the decode costs are averaged instead."""
        self.fit.observe(shape.features(), measured_ms, fade=shape.num_prefill_tokens > 0)

    def calibrated(self, pairs_seen: bool = False) -> None:
        """The steps observed so far were timed to measure this machine (a fresh engine's
        calibration, ember.engine.calibration): the prior's costs no longer weigh on the
        fit, but for the attention pairs' unless `pairs_seen` (chunks over a long context
        among the steps: short contexts alone hardly tell a pair's cost from a token's;
        left free, the fit put a 512-token chunk's whole cost on its pairs in one of two
        fresh starts, and so predicted a chunk after 2,000 tokens at 1 s) and a faint pull
        on what they left undetermined."""
        self.fit.drop_prior(keep=() if pairs_seen else (ATTENTION,))

    def max_prefill_tokens(
        self, num_decode_rows: int, num_computed: int, max_ms: float, limit: int
    ) -> int:
        """The largest prefill chunk (<= limit) that a step with these decodes, its chunk
        starting after `num_computed` tokens, is predicted to finish within `max_ms`."""

        def fits(n: int) -> bool:
            shape = StepShape(n, num_decode_rows, StepShape.chunk_pairs(num_computed, n))
            return self.predict_ms(shape) <= max_ms

        lo, hi = 0, max(limit, 0)  # predictions grow with n: bisect for the last that fits
        if fits(hi):
            return hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo if fits(lo) else 0

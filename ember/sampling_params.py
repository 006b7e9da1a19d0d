"""How to pick the next token, and when to stop."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """Sampling and stopping options of one request.

    temperature 0 means greedy. top_k 0 or -1 means no top-k. `seed` makes a request's
    samples reproducible whatever else shares its batch. `stop` strings end the output and
    are not part of its text; `stop_token_ids` end it too (their token is kept in
    token_ids, like EOS). `logprobs=N` returns the chosen token's log-probability and the
    N most likely alternatives at each step.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= 0, "top_k", f"must be >= 0 or -1 (off), got {self.top_k}")
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2 <= value <= 2, name, f"must be in [-2, 2], got {value}")
        _check(
            self.repetition_penalty > 0,
            "repetition_penalty",
            f"must be > 0, got {self.repetition_penalty}",
        )
        _check(
            self.max_tokens is None or self.max_tokens >= 1,
            "max_tokens",
            f"must be >= 1, got {self.max_tokens}",
        )
        _check(
            self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
            "logprobs",
            f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"
        )
        _check(
            all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be non-negative token ids",
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ValueError(f"{param} {message}")

"""A trace as the requests a cluster must serve (`Demand`).

Mooncake-format JSONL (`timestamp` ms, `input_length`, `output_length`, `hash_ids` of
512-token blocks) is shaped exactly as `ember bench serve --workload trace` replays it:
each hash id becomes `block_tokens` tokens, output lengths are scaled by `output_scale`,
timestamps by `time_scale`. A prompt's tokens already seen as the leading blocks of an
earlier prompt are taken as prefix-cache hits (an unbounded cache: the router's prefix
routing sends a prompt to the worker holding its prefix). An `ember bench serve --out`
JSON gives each request's start, prompt, cached and output tokens as they were measured.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Request:
    arrival: float  # seconds from the first request
    prompt_tokens: int
    new_tokens: int  # the prompt's tokens no prefix cache holds: what prefill computes
    output_tokens: int


@dataclass(frozen=True)
class Demand:
    requests: tuple[Request, ...]

    def __post_init__(self) -> None:
        if len(self.requests) < 2:
            raise ValueError("a trace needs at least 2 requests to have a rate")
        if self.span <= 0:
            raise ValueError("the trace's requests all arrive at once: it has no rate")

    @property
    def span(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.requests[-1].arrival - self.requests[0].arrival

    @property
    def rate(self) -> float:
        """Requests per second (n - 1 gaps over the span)."""
        return (len(self.requests) - 1) / self.span

    def mean(self, field: str) -> float:
        return statistics.fmean(getattr(r, field) for r in self.requests)

    def summary(self) -> dict:
        return {
            "requests": len(self.requests),
            "span_s": round(self.span, 2),
            "rate_per_s": round(self.rate, 3),
            "mean_prompt_tokens": round(self.mean("prompt_tokens"), 1),
            "mean_new_tokens": round(self.mean("new_tokens"), 1),
            "mean_output_tokens": round(self.mean("output_tokens"), 1),
        }


def load_trace(
    path: str | Path,
    start: int = 0,
    count: int | None = None,
    block_tokens: int = 32,
    output_scale: float | None = None,
    time_scale: float = 1.0,
) -> Demand:
    """A Mooncake JSONL trace (shaped as `ember bench serve` replays it) or an `ember bench
    serve --out` JSON file (one JSON object with `requests`)."""
    text = Path(path).read_text()
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None  # one JSON object a line: Mooncake
    if isinstance(whole, dict) and "requests" in whole:
        return from_bench(whole)
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0 (the plan needs arrival times), got {time_scale}")
    records = []
    for n, line in enumerate(text.splitlines()):
        if n < start or not line.strip():
            continue
        records.append(json.loads(line))
        if count is not None and len(records) == count:
            break
    return from_mooncake(records, block_tokens, output_scale, time_scale)


def from_mooncake(
    records: list[dict], block_tokens: int, output_scale: float | None, time_scale: float
) -> Demand:
    scale = block_tokens / 512
    output_scale = scale if output_scale is None else output_scale
    seen: set[int] = set()  # every leading run of blocks served so far, by chained hash
    if not records:
        raise ValueError("the trace has no requests")
    t0 = records[0]["timestamp"]
    requests = []
    for record in records:
        ids = record["hash_ids"]
        prompt = min(max(round(record["input_length"] * scale), 1), len(ids) * block_tokens)
        hit, chain = 0, 0
        for i, hash_id in enumerate(ids):
            chain = hash((chain, hash_id))  # stands for the run of blocks up to this one
            if hit == i and chain in seen:  # the leading blocks seen so far
                hit += 1
            seen.add(chain)
        cached = min(hit * block_tokens, prompt - 1)  # the last token is always computed
        output = max(round(record["output_length"] * output_scale), 1)
        arrival = (record["timestamp"] - t0) / 1000 * time_scale
        requests.append(Request(arrival, prompt, prompt - cached, output))
    return Demand(tuple(sorted(requests, key=lambda r: r.arrival)))


def from_bench(result: dict) -> Demand:
    """The requests an `ember bench serve --out` run sent (those that completed)."""
    rows = [r for r in result.get("requests", []) if r.get("error") is None]
    if not rows:
        raise ValueError("the ember bench result holds no completed request")
    t0 = min(r["start"] for r in rows)
    requests = [
        Request(
            r["start"] - t0,
            r["prompt_tokens"],
            max(r["prompt_tokens"] - r["cached_tokens"], 1),
            max(r["output_tokens"], 1),
        )
        for r in rows
    ]
    return Demand(tuple(sorted(requests, key=lambda r: r.arrival)))

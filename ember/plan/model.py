"""From a worker profile and a demand to predicted TTFT, ITL and utilisation, and the
smallest cluster that meets the SLOs.

Notation: for request i, `n_i` new (uncached) prompt tokens after `c_i` cached ones,
`o_i` output tokens; `lam` the trace's mean rate; E[.] the mean over the trace.

Prompts wait their turn: the trace's own requests, at their own arrival times, go through
the workers that compute prompts, first come first served, each to the worker that is
free first (as a router balancing by work in flight sends it): `replay_queue`. Bursts
and long prompts in the trace queue as they would; a request's TTFT is its wait, its
prefill and what follows; the mean and 90th percentile are taken over the requests.

Disaggregated, P prefill and D decode workers:
- a prefill worker's service: S_i = prefill_ms(n_i, c_i), replayed over P workers;
- the KV hand-off: prompt tokens x kv_bytes_per_token at `kv_gbps`;
- TTFT_i = wait_i + S_i + hand-off_i + one decode step;
- a decode worker takes r = lam E[o] / D tokens per ms and holds N sequences whose
  steps last d(N) = base + N k (k = per_row + per_krow x the mean context while
  decoding, c + n + o / 2). Little's law, N = r d(N), gives N = r base / (1 - r k),
  stable while r k < 1; ITL = d(N), its p90 d(N + 1.28 sqrt(N)) (N varies as a Poisson
  count does).

Mixed, M workers, each doing both in the same steps (chunked prefill): a worker's
prompts add U = lam / M x E[prefill_work] of work per ms of wall time (their share past
a step's fixed cost), so decode steps stretch to d(N) / (1 - U) on average and N =
r base / ((1 - U) - r k), stable while U + r k < 1 (r = lam E[o] / M). A prompt goes in
chunks: with decodes running, a step holds up to the tokens that keep it within
`max_step_ms` (the step budget; 0: `max_num_batched_tokens`). A request's prefill takes
ceil(n / chunk) such steps, each also carrying the N decodes: that is its service in the
replay over the M workers. A decoding sequence sees every step of its worker: of those,
the ones carrying a chunk (lam / M x E[steps] a ms) among the decode-only ones that fill
the rest of the time; where 1 step in 10 or more carries a chunk, the p90 gap is a step
with a chunk (a whole one, or a mean prompt's new tokens if fewer); else as above. A
worker with an ITL target (`target_itl_ms`) below such a step runs its chunks in slices
with a decode step after each target's worth of prefill: the gap is then the target, and
a prompt's service carries those decode steps too.

The predictions are means and 90th percentiles of TTFT and ITL; an SLO `ttft=MS,itl=MS`
is met by a configuration whose p90s are within it. Utilisation: the share of time a
role's workers are busy.
"""

from __future__ import annotations

import heapq
import math
import statistics
from dataclasses import asdict, dataclass

from ember.plan.demand import Demand
from ember.plan.profile import WorkerProfile

P90_Z = 1.2816  # the standard normal's 90th percentile


def replay_queue(arrivals: list[float], service: list[float], servers: int) -> list[float]:
    """Each request's wait (ms) before a server takes it: requests in arrival order, first
    come first served, each to the server free first."""
    free = [(0.0, server) for server in range(servers)]  # (next free at, ms; server)
    waits = []
    for arrival, work in sorted(zip(arrivals, service, strict=True), key=lambda x: x[0]):
        at, server = heapq.heappop(free)
        start = max(arrival, at)
        waits.append(start - arrival)
        heapq.heappush(free, (start + work, server))
    order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
    out = [0.0] * len(arrivals)
    for rank, index in enumerate(order):
        out[index] = waits[rank]
    return out


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


@dataclass(frozen=True)
class Prediction:
    mode: str  # "disaggregated" | "mixed"
    prefill: int  # workers of each kind
    decode: int
    mixed: int
    ttft_ms: float  # mean
    ttft_p90_ms: float
    itl_ms: float
    itl_p90_ms: float
    utilization: dict[str, float]  # busy share of each role's workers
    running_per_worker: float  # sequences decoding on a decode (or mixed) worker

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.mixed

    @property
    def stable(self) -> bool:
        return math.isfinite(self.ttft_p90_ms) and math.isfinite(self.itl_p90_ms)

    def meets(self, slo: dict[str, float]) -> bool:
        return (
            self.stable
            and self.ttft_p90_ms <= slo.get("ttft", math.inf)
            and self.itl_p90_ms <= slo.get("itl", math.inf)
        )

    def command(self) -> str:
        """The `ember up` line that runs this configuration on one machine."""
        if self.mode == "mixed":
            return f"ember up --mixed {self.mixed}"
        return f"ember up --prefill {self.prefill} --decode {self.decode}"

    def as_dict(self) -> dict:
        out = asdict(self)
        for key, value in out.items():
            if isinstance(value, float):
                out[key] = round(value, 1) if math.isfinite(value) else None
        out["utilization"] = {k: round(v, 3) for k, v in self.utilization.items()}
        out["command"] = self.command()
        return out


def _decode_state(rate: float, base: float, per_seq: float, slack: float = 1.0):
    """(N, d(N)) of a worker taking `rate` tokens per ms whose steps last base + N per_seq
    stretched by 1 / slack; None when it cannot keep up."""
    room = slack - rate * per_seq
    if room <= 0:
        return None
    n = rate * base / room
    return n, (base + per_seq * n) / slack


def _decode_context(demand: Demand) -> float:
    return statistics.fmean(r.prompt_tokens + r.output_tokens / 2 for r in demand.requests)


def _per_seq_ms(profile: WorkerProfile, context: float) -> float:
    _, per_row, per_krow = profile.coefficients["decode"]
    return per_row + per_krow * context / 1000


def _prompt_waits(demand: Demand, service: list[float], servers: int) -> list[float]:
    """Each request's wait for a worker to take its prompt (`replay_queue`); inf for all
    where the workers cannot keep up with the trace's mean rate."""
    if demand.rate / 1000 * statistics.fmean(service) >= servers:
        return [math.inf] * len(service)
    return replay_queue([r.arrival * 1000 for r in demand.requests], service, servers)


def predict_disaggregated(
    profile: WorkerProfile, demand: Demand, prefill: int, decode: int, kv_gbps: float = 2.0
) -> Prediction:
    rate = demand.rate / 1000  # per ms
    service = [profile.prefill_ms(r.new_tokens, r.prompt_tokens - r.new_tokens)
               for r in demand.requests]  # fmt: skip
    handoff = [
        r.prompt_tokens * profile.kv_bytes_per_token / (kv_gbps * 1e6) for r in demand.requests
    ]  # fmt: skip  (bytes / (GB/s) in ms)
    waits = _prompt_waits(demand, service, prefill)
    context = _decode_context(demand)
    base = profile.coefficients["decode"][0]
    tokens_rate = rate * demand.mean("output_tokens") / decode
    per_seq = _per_seq_ms(profile, context)
    state = _decode_state(tokens_rate, base, per_seq)
    if state is None:
        running, itl, itl_p90 = math.inf, math.inf, math.inf
    else:
        running, itl = state
        itl_p90 = profile.decode_ms(running + P90_Z * math.sqrt(running), context)
    ttft = [w + s + h + itl for w, s, h in zip(waits, service, handoff, strict=True)]
    return Prediction(
        "disaggregated", prefill, decode, 0, statistics.fmean(ttft), p90(ttft), itl, itl_p90,
        {"prefill": rate * statistics.fmean(service) / prefill,
         "decode": tokens_rate * per_seq if state else 1.0},
        running,
    )  # fmt: skip


def predict_mixed(profile: WorkerProfile, demand: Demand, workers: int) -> Prediction:
    rate = demand.rate / 1000 / workers  # each worker's, per ms
    work = [profile.prefill_work_ms(r.new_tokens, r.prompt_tokens - r.new_tokens)
            for r in demand.requests]  # fmt: skip
    prefill_share = rate * statistics.fmean(work)
    context = _decode_context(demand)
    per_seq = _per_seq_ms(profile, context)
    base = profile.coefficients["decode"][0]
    tokens_rate = rate * demand.mean("output_tokens")
    state = _decode_state(tokens_rate, base, per_seq, slack=1 - prefill_share)
    utilization = {"mixed": min(prefill_share + tokens_rate * per_seq, 1.0)}
    if state is None:
        inf = math.inf
        return Prediction("mixed", 0, 0, workers, inf, inf, inf, inf, utilization, inf)
    running, itl = state
    decode_step = profile.decode_ms(running, context)
    per_token = profile.coefficients["prefill"][1] or 1e-9
    if profile.max_step_ms > 0:  # chunks sized to keep a step with decodes in budget
        chunk = max((profile.max_step_ms - decode_step) / per_token, 16.0)
        chunk = min(chunk, profile.max_num_batched_tokens)
    else:
        chunk = profile.max_num_batched_tokens
    # a step carrying a chunk: a whole one, or what is left of a shorter prompt
    chunk_step = decode_step + min(chunk, demand.mean("new_tokens")) * per_token
    steps = [max(math.ceil(r.new_tokens / chunk), 1) for r in demand.requests]
    prefill = [profile.prefill_ms(r.new_tokens, r.prompt_tokens - r.new_tokens)
               for r in demand.requests]  # fmt: skip
    # an ITL target below such a step: its chunk runs in slices, a decode step after each
    # target's worth (less the decode step) of prefill, so the decodes' gaps are about the
    # target and a prompt carries those extra decode steps (where decodes are running)
    target = profile.target_itl_ms
    sliced = 0 < target < chunk_step
    if sliced:
        slice_ms = max(target - decode_step, 1e-3)
        extra = [max(math.ceil(ms / slice_ms) - k, 0) for ms, k in zip(prefill, steps, strict=True)]
        steps = [k + min(running, 1.0) * e for k, e in zip(steps, extra, strict=True)]
        chunk_step = max(target, decode_step)
    service = [ms + k * decode_step for ms, k in zip(prefill, steps, strict=True)]
    waits = _prompt_waits(demand, service, workers)
    ttft = [w + s + itl for w, s in zip(waits, service, strict=True)]
    # of the steps a decoding sequence sees, those that carry a chunk
    chunk_steps = rate * statistics.fmean(steps)  # a ms
    # (a fit may find decode steps free at no load: then they fill the time)
    other_steps = max(1 - chunk_steps * chunk_step, 0.0) / max(decode_step, 1e-9)
    itl_p90 = profile.decode_ms(running + P90_Z * math.sqrt(running), context)
    if chunk_steps >= 0.1 * (chunk_steps + other_steps):
        itl_p90 = max(itl_p90, chunk_step)
    return Prediction(
        "mixed", 0, 0, workers, statistics.fmean(ttft), p90(ttft), itl, itl_p90, utilization,
        running,
    )  # fmt: skip


def _smaller(prediction: Prediction) -> tuple[int, float]:
    """Fewest workers first; then the lower TTFT p90 + ITL p90 (no unit dominates)."""
    return prediction.workers, prediction.ttft_p90_ms + prediction.itl_p90_ms


@dataclass(frozen=True)
class Plan:
    disaggregated: Prediction | None  # the smallest meeting the SLO (None: none up to max)
    mixed: Prediction | None
    considered: list[Prediction]

    @property
    def best(self) -> Prediction | None:
        options = [p for p in (self.disaggregated, self.mixed) if p is not None]
        if not options:
            return None
        return min(options, key=_smaller)


def plan(
    profile: WorkerProfile,
    demand: Demand,
    slo: dict[str, float],
    max_workers: int = 16,
    kv_gbps: float = 2.0,
) -> Plan:
    """Every split of up to `max_workers` workers, and the smallest of each mode that meets
    `slo` (ties: the lower p90s)."""
    if max_workers < 1:
        raise ValueError(f"max_workers must be >= 1, got {max_workers}")
    considered = [predict_mixed(profile, demand, m) for m in range(1, max_workers + 1)]
    considered += [
        predict_disaggregated(profile, demand, p, d, kv_gbps)
        for p in range(1, max_workers)
        for d in range(1, max_workers - p + 1)
    ]

    def smallest(mode: str) -> Prediction | None:
        fits = [p for p in considered if p.mode == mode and p.meets(slo)]
        return min(fits, key=_smaller, default=None)

    return Plan(smallest("disaggregated"), smallest("mixed"), considered)


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=MS,itl=MS` (either or both) as milliseconds by name."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or name not in ("ttft", "itl"):
            raise ValueError(f"--slo takes ttft=MS,itl=MS; got {part!r}")
        try:
            slo[name] = float(value)
        except ValueError:
            raise ValueError(f"--slo {name}: {value!r} is not a number of ms") from None
        if not slo[name] > 0:
            raise ValueError(f"--slo {name} must be > 0 ms, got {value}")
    if not slo:
        raise ValueError("--slo needs ttft=MS and/or itl=MS")
    return slo

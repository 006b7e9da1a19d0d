"""From a worker profile and a demand to predicted TTFT, ITL and utilisation, and the
smallest cluster that meets the SLOs.

The requests arrive at the demand's mean rate, `lam` per second, taken as Poisson; the
router spreads them evenly over the workers of a role. Notation: for request i, `n_i`
new (uncached) prompt tokens after `c_i` cached ones, `o_i` output tokens; E[.] the mean
over the trace.

Disaggregated, P prefill and D decode workers:
- a prefill worker runs prompts one after another: service S_i = prefill_ms(n_i, c_i),
  so P servers of an M/G/P queue. Waiting time by Allen-Cunneen: the Erlang-C chance
  C of waiting at all, times E[S] / (P - a) (a = lam E[S], the busy servers), times
  (1 + cv^2) / 2 (cv: S's coefficient of variation); its 90th percentile from the same
  exponential tail: E[W | wait] ln(C / 0.1), 0 when C <= 0.1;
- the KV hand-off: prompt tokens x kv_bytes_per_token at `kv_gbps`;
- TTFT = wait + S + hand-off + one decode step, mean and p90 (S's own p90 over the trace);
- a decode worker takes r = lam E[o] / D tokens per ms and holds N sequences whose
  steps last d(N) = base + N k (k = per_row + per_krow x the mean context while
  decoding, c + n + o / 2). Little's law, N = r d(N), gives N = r base / (1 - r k),
  stable while r k < 1; ITL = d(N), its p90 d(N + 1.28 sqrt(N)) (N varies as a Poisson
  count does).

Mixed, M workers, each doing both in the same steps (chunked prefill): a worker's
prompts add U = lam / M x E[prefill_work] of work per ms of wall time (their share past
a step's fixed cost), so decode steps stretch to d(N) / (1 - U) on average and N =
r base / ((1 - U) - r k), stable while U + r k < 1 (r = lam E[o] / M). A prompt
goes in chunks: with decodes running, a step holds up to the tokens that keep it within
`max_step_ms` (the step budget; 0: `max_num_batched_tokens`). A request's prefill takes
ceil(n / chunk) such steps, each also carrying the N decodes, and waits for the
prompts before it (one server: Allen-Cunneen with P = 1 over those times). ITL p90: the
time of a step with a chunk (a whole one, or a mean prompt's new tokens if fewer) where
at least 1 step in 10 holds one; else as above.

The predictions are means and 90th percentiles of TTFT and ITL; an SLO `ttft=MS,itl=MS`
is met by a configuration whose p90s are within it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

from ember.plan.demand import Demand
from ember.plan.profile import WorkerProfile

P90_Z = 1.2816  # the standard normal's 90th percentile


def erlang_c(servers: int, offered: float) -> float:
    """The chance that an arrival waits in an M/M/c queue with `offered` = lam / mu."""
    if offered >= servers:
        return 1.0
    term, total = 1.0, 1.0  # offered^k / k!, summed for k < servers
    for k in range(1, servers):
        term *= offered / k
        total += term
    last = term * offered / servers / (1 - offered / servers)
    return last / (total + last)


def queue_wait_ms(rate_per_ms: float, service: list[float], servers: int) -> tuple[float, float]:
    """(mean, p90) of the wait before service in an M/G/c queue (Allen-Cunneen); inf when
    the servers cannot keep up."""
    mean_s = statistics.fmean(service)
    offered = rate_per_ms * mean_s
    if offered >= servers:
        return math.inf, math.inf
    cv2 = statistics.pvariance(service) / mean_s**2 if mean_s > 0 else 0.0
    waits = erlang_c(servers, offered)
    given_wait = mean_s / (servers - offered) * (1 + cv2) / 2  # the mean wait of those who wait
    p90 = given_wait * math.log(waits / 0.1) if waits > 0.1 else 0.0
    return waits * given_wait, p90


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


def predict_disaggregated(
    profile: WorkerProfile, demand: Demand, prefill: int, decode: int, kv_gbps: float = 2.0
) -> Prediction:
    rate = demand.rate / 1000  # per ms
    service = [profile.prefill_ms(r.new_tokens, r.prompt_tokens - r.new_tokens)
               for r in demand.requests]  # fmt: skip
    wait, wait_p90 = queue_wait_ms(rate, service, prefill)
    handoff = [
        r.prompt_tokens * profile.kv_bytes_per_token / (kv_gbps * 1e6) for r in demand.requests
    ]  # fmt: skip  (bytes / (GB/s) in ms)
    context = _decode_context(demand)
    base = profile.coefficients["decode"][0]
    tokens_rate = rate * demand.mean("output_tokens") / decode
    state = _decode_state(tokens_rate, base, _per_seq_ms(profile, context))
    if state is None:
        running, itl, itl_p90 = math.inf, math.inf, math.inf
    else:
        running, itl = state
        itl_p90 = profile.decode_ms(running + P90_Z * math.sqrt(running), context)
    mean_ttft = wait + statistics.fmean(service) + statistics.fmean(handoff) + itl
    ttft_p90 = wait_p90 + p90([s + h for s, h in zip(service, handoff, strict=True)]) + itl_p90
    return Prediction(
        "disaggregated", prefill, decode, 0, mean_ttft, ttft_p90, itl, itl_p90,
        {"prefill": rate * statistics.fmean(service) / prefill,
         "decode": tokens_rate * _per_seq_ms(profile, context) if state else 1.0},
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
    service = [
        profile.prefill_ms(r.new_tokens, r.prompt_tokens - r.new_tokens) + k * decode_step
        for r, k in zip(demand.requests, steps, strict=True)
    ]
    wait, wait_p90 = queue_wait_ms(rate, service, 1)
    chunk_share = rate * statistics.fmean(steps) * chunk_step  # of wall time, in chunk steps
    itl_p90 = profile.decode_ms(running + P90_Z * math.sqrt(running), context)
    if chunk_share >= 0.1:
        itl_p90 = max(itl_p90, chunk_step)
    return Prediction(
        "mixed", 0, 0, workers, wait + statistics.fmean(service) + itl,
        wait_p90 + p90(service) + itl_p90, itl, itl_p90, utilization, running,
    )  # fmt: skip


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
        # fewest workers; then the lower TTFT p90 + ITL p90 (no unit dominates)
        return min(options, key=lambda p: (p.workers, p.ttft_p90_ms + p.itl_p90_ms))


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
        return min(fits, key=lambda p: (p.workers, p.ttft_p90_ms + p.itl_p90_ms), default=None)

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

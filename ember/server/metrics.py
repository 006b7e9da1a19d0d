"""Prometheus metrics (`ember_` namespace), one registry per server.

Per-request timings are observed by a `RequestTimer` that the serving code feeds every
output; engine gauges are read from the latest engine stats at scrape time.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ember.distributed.parallel import split
from ember.outputs import RequestOutput

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


class ServerMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def latency(name: str, doc: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r)

        self.ttft = latency("ember_time_to_first_token_seconds", "Time to first token.")
        self.itl = latency("ember_inter_token_latency_seconds", "Time between output tokens.")
        self.e2e = latency("ember_e2e_request_latency_seconds", "Request arrival to last token.")
        self.queue = latency(
            "ember_request_queue_time_seconds", "Time waiting before first scheduled."
        )
        self.prompt_tokens = Counter(
            "ember_prompt_tokens", "Prompt tokens received.", labels, registry=r
        )
        self.cached_tokens = Counter(
            "ember_prompt_tokens_cached", "Prompt tokens served from the prefix cache.",
            labels, registry=r,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "ember_generation_tokens", "Output tokens generated.", labels, registry=r
        )
        self.requests = Counter(
            "ember_requests", "Finished requests by finish reason.",
            ["model_name", "finish_reason"], registry=r,
        )  # fmt: skip
        self.running = Gauge("ember_num_requests_running", "Running requests.", labels, registry=r)
        self.waiting = Gauge("ember_num_requests_waiting", "Waiting requests.", labels, registry=r)
        self.kv_usage = Gauge(
            "ember_kv_cache_usage_ratio", "Share of KV blocks in use.", labels, registry=r
        )
        self.prompt_computed = Gauge(
            "ember_prompt_tokens_computed", "Prompt tokens the model computed (not cached, "
            "not received from a prefill worker), since start.", labels, registry=r,
        )  # fmt: skip
        self.kv_loads = Gauge(
            "ember_kv_transfers", "KV transfers received from prefill workers, since start.",
            ["model_name", "result"], registry=r,
        )  # fmt: skip
        self.kv_bytes = Gauge(
            "ember_kv_transfer_bytes", "KV bytes moved, since start.",
            ["model_name", "direction"], registry=r,
        )  # fmt: skip
        self.kv_tier_blocks = Gauge(
            "ember_kv_tier_blocks", "KV blocks by tier below the pool (host, disk, cluster) "
            "and event (hit, write, write_dropped, eviction, corrupt), since start.",
            ["model_name", "tier", "event"], registry=r,
        )  # fmt: skip
        self.kv_tier_bytes = Gauge(
            "ember_kv_tier_bytes_loaded", "KV bytes loaded from each tier, since start.",
            ["model_name", "tier"], registry=r,
        )  # fmt: skip
        self.kv_tier_seconds = Gauge(
            "ember_kv_tier_load_seconds", "Seconds spent loading from each tier, since start.",
            ["model_name", "tier"], registry=r,
        )  # fmt: skip
        self.kv_held = Gauge(
            "ember_kv_transfers_held", "Finished prefills whose blocks wait for a decode worker.",
            labels, registry=r,
        )  # fmt: skip
        self.steps = Gauge("ember_engine_steps", "Model steps, since start.", labels, registry=r)
        self.restarts = Gauge(
            "ember_engine_restarts", "Engine cores started again after one died.", labels,
            registry=r,
        )  # fmt: skip
        self.step_seconds = Gauge(
            "ember_engine_step_seconds", "Model steps' durations, measured and as the step "
            "cost model predicted them (and |measured - predicted|), summed since start.",
            ["model_name", "kind"], registry=r,
        )  # fmt: skip
        self.capped_steps = Gauge(
            "ember_engine_step_budget_capped_steps", "Steps whose prefill chunk the step "
            "budget (--max-step-ms) shrank so that running decodes stay fast, since start.",
            labels, registry=r,
        )  # fmt: skip
        self.sliced_steps = Gauge(
            "ember_engine_sliced_prompt_steps", "Steps of prompt chunks run a slice of "
            "layers at a time, decodes stepping between the slices (--target-itl-ms), "
            "since start.",
            labels, registry=r,
        )  # fmt: skip
        self.target_itl = Gauge(
            "ember_engine_target_itl_ms", "The inter-token latency target prompt steps are "
            "sliced for (--target-itl-ms; auto: as this machine's step costs give it; 0: "
            "off).", labels, registry=r,
        )  # fmt: skip
        self.prefill_cap = Gauge(
            "ember_engine_step_budget_prefill_tokens", "The prefill tokens the step budget "
            "allowed the last step it shrank.", labels, registry=r,
        )  # fmt: skip
        self.expert_tokens = Gauge(
            "ember_moe_expert_tokens", "MoE models: tokens routed to each expert of each MoE "
            "layer, since start.", [*labels, "layer", "expert"], registry=r,
        )  # fmt: skip
        self.rank_tokens = Gauge(
            "ember_moe_rank_tokens", "MoE models with expert parallel: tokens routed to each "
            "rank's experts, per MoE layer, since start.", [*labels, "layer", "rank"],
            registry=r,
        )  # fmt: skip
        self.expert_imbalance = Gauge(
            "ember_moe_expert_imbalance", "MoE models: the busiest expert's tokens over the "
            "mean, per MoE layer (1: balanced).", [*labels, "layer"], registry=r,
        )  # fmt: skip
        self.spec_tokens = Gauge(
            "ember_spec_decode_tokens", "Speculative decoding: draft tokens proposed and "
            "accepted, and verifications (drafts), since start.", [*labels, "kind"],
            registry=r,
        )  # fmt: skip
        self.spec_position = Gauge(
            "ember_spec_decode_accepted_per_position", "Speculative decoding: drafts accepted "
            "at each position of a request's drafts, since start.", [*labels, "position"],
            registry=r,
        )  # fmt: skip
        self.startup = Gauge(
            "ember_startup_seconds", "When each start-up phase ended, in seconds since the "
            "server process began (ember.startup).", ["model_name", "process", "phase"],
            registry=r,
        )  # fmt: skip
        self.startup_cpu = Gauge(
            "ember_startup_cpu_seconds", "CPU time each process had used when each of its "
            "start-up phases ended.", ["model_name", "process", "phase"], registry=r,
        )  # fmt: skip
        self.model_name = model_name

    def set_startup(self, processes: dict[str, list[tuple[str, float, float]]]) -> None:
        for process, phases in processes.items():
            for phase, seconds, cpu in phases:
                self.startup.labels(self.model_name, process, phase).set(seconds)
                self.startup_cpu.labels(self.model_name, process, phase).set(cpu)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)

    def render(
        self, stats, num_waiting: int, expert_tokens=(), expert_ranks: int = 1, restarts: int = 0
    ) -> bytes:
        """`expert_ranks`: the ranks the experts are split over (expert parallel);
        `restarts`: of the engine core."""
        name = self.model_name
        self.restarts.labels(name).set(restarts)
        for layer, counts in expert_tokens:
            for expert, count in enumerate(counts):
                self.expert_tokens.labels(name, str(layer), str(expert)).set(count)
            for rank in range(expert_ranks if expert_ranks > 1 else 0):
                first, num = split(len(counts), expert_ranks, rank)
                tokens = sum(counts[first : first + num])
                self.rank_tokens.labels(name, str(layer), str(rank)).set(tokens)
            mean = sum(counts) / len(counts)
            self.expert_imbalance.labels(name, str(layer)).set(max(counts) / mean if mean else 0)
        self.running.labels(name).set(stats.num_running)
        self.waiting.labels(name).set(num_waiting)
        self.kv_usage.labels(name).set(stats.kv_blocks_used / max(stats.kv_blocks_total, 1))
        self.prompt_computed.labels(name).set(stats.num_prompt_tokens_computed)
        self.kv_loads.labels(name, "ok").set(stats.kv_loads_ok)
        self.kv_loads.labels(name, "failed").set(stats.kv_loads_failed)
        self.kv_bytes.labels(name, "received").set(stats.kv_bytes_received)
        self.kv_bytes.labels(name, "sent").set(stats.kv_bytes_sent)
        self.kv_held.labels(name).set(stats.kv_held)
        for tier, counters in (stats.kv_tiers or {}).items():
            for event, field in _TIER_EVENTS.items():
                self.kv_tier_blocks.labels(name, tier, event).set(counters[field])
            self.kv_tier_bytes.labels(name, tier).set(counters["bytes_loaded"])
            self.kv_tier_seconds.labels(name, tier).set(counters["load_seconds"])
        self.steps.labels(name).set(stats.num_steps)
        self.step_seconds.labels(name, "measured").set(stats.step_seconds)
        self.step_seconds.labels(name, "predicted").set(stats.step_predicted_seconds)
        self.step_seconds.labels(name, "error").set(stats.step_error_seconds)
        self.capped_steps.labels(name).set(stats.num_capped_steps)
        self.sliced_steps.labels(name).set(stats.num_sliced_steps)
        self.prefill_cap.labels(name).set(stats.last_prefill_cap)
        self.target_itl.labels(name).set(stats.target_itl_ms)
        if (spec := stats.spec_decode) is not None:
            self.spec_tokens.labels(name, "draft").set(spec["num_draft_tokens"])
            self.spec_tokens.labels(name, "accepted").set(spec["num_accepted_tokens"])
            self.spec_tokens.labels(name, "drafts").set(spec["num_drafts"])
            for position, count in enumerate(spec["accepted_per_position"]):
                self.spec_position.labels(name, str(position)).set(count)
        return generate_latest(self.registry)


_TIER_EVENTS = {"hit": "hits", "write": "writes", "write_dropped": "writes_dropped",
                "eviction": "evictions", "corrupt": "corrupt",
                "write_error": "write_errors"}  # fmt: skip


class RequestTimer:
    """Follows one engine request's outputs; records its timings and counts when done."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True

    def observe(self, output: RequestOutput) -> None:
        m, name = self.metrics, self.metrics.model_name
        now = time.perf_counter()
        num_new = sum(len(o.delta_token_ids) for o in output.outputs)
        if self.first and num_new:
            self.first = False
            m.ttft.labels(name).observe(now - self.start)
            if output.queue_time is not None:
                m.queue.labels(name).observe(output.queue_time)
        elif num_new:
            m.itl.labels(name).observe((now - self.last) / num_new)
        self.last = now
        if num_new:
            m.generation_tokens.labels(name).inc(num_new)
        if output.finished:
            m.e2e.labels(name).observe(now - self.start)
            m.prompt_tokens.labels(name).inc(len(output.prompt_token_ids))
            m.cached_tokens.labels(name).inc(output.num_cached_tokens)
            for seq in output.outputs:
                m.requests.labels(name, seq.finish_reason).inc()

    def aborted(self) -> None:
        self.metrics.requests.labels(self.metrics.model_name, "abort").inc()

"""Every environment variable ember reads, in one place."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Where downloaded models live: $EMBER_CACHE_DIR or ~/.cache/ember."""
    return Path(os.environ.get("EMBER_CACHE_DIR", Path.home() / ".cache" / "ember"))


def log_level() -> str:
    """Log level for the `ember` loggers: $EMBER_LOG_LEVEL (default INFO)."""
    return os.environ.get("EMBER_LOG_LEVEL", "INFO").upper()


def api_key() -> str | None:
    """The key clients must show when --api-key / --api-key-file are not given: $EMBER_API_KEY."""
    return os.environ.get("EMBER_API_KEY") or None


PLACEHOLDER_SECRET = "REPLACE-ME"  # what deploy/kubernetes ships in place of a secret


def cluster_secret() -> bytes | None:
    """The cluster's shared secret: $EMBER_CLUSTER_SECRET (never on a command line, where
    other users could read it). Workers that have it serve only their router and sign the
    prefills they hand over; KV endpoints admit only peers that prove it (`ember.cluster`)."""
    value = os.environ.get("EMBER_CLUSTER_SECRET")
    if value and value.startswith(PLACEHOLDER_SECRET):
        raise ValueError("EMBER_CLUSTER_SECRET is the deploy manifests' placeholder: set a "
                         "secret of your own (e.g. `openssl rand -hex 32`)")  # fmt: skip
    return value.encode() if value else None


MATMUL_PRECISIONS = ("auto", "ieee", "bf16", "int8")


def matmul_precision() -> str:
    """`matmul_precision` where none is given: $EMBER_MATMUL_PRECISION, else "auto" (one of
    MATMUL_PRECISIONS); set in the environment, it reaches the engines of child processes."""
    value = os.environ.get("EMBER_MATMUL_PRECISION", "").strip().lower() or "auto"
    if value not in MATMUL_PRECISIONS:
        raise ValueError(f"EMBER_MATMUL_PRECISION must be auto, ieee, bf16 or int8; got {value!r}")
    return value


CPU_ISAS = ("avx512", "avx2", "generic")  # ember's CPU kernel builds, fastest first


def cpu_isa() -> str | None:
    """The CPU kernel build to use whatever the CPU offers: $EMBER_CPU_ISA, one of
    CPU_ISAS (a path the CPU cannot run is refused when the kernels load); unset, the
    fastest the CPU runs."""
    value = os.environ.get("EMBER_CPU_ISA", "").strip().lower()
    if not value:
        return None
    if value not in CPU_ISAS:
        raise ValueError(f"EMBER_CPU_ISA must be one of {', '.join(CPU_ISAS)}; got {value!r}")
    return value


ENGINE_GOMP_SPINCOUNT = "10000000"


def engine_core_env() -> dict[str, str]:
    """The engine-core process's environment: this one's, with $GOMP_SPINCOUNT (libgomp,
    which torch's OpenMP threads run on) at 10 million unless already set. The default
    (300 thousand spins, ~0.1 ms) lets the threads fall asleep between a step's parallel
    regions whenever the API process takes their core for a moment, and each futex
    sleep and wake delays the whole region; spinning a few ms longer measured +5-12%
    output tokens/s over HTTP, and idle threads still go to sleep (idle CPU unchanged)."""
    env = dict(os.environ)
    env.setdefault("GOMP_SPINCOUNT", ENGINE_GOMP_SPINCOUNT)
    return env


def pipeline_steps_in_flight(num_stages: int) -> int:
    """Steps a pipeline-parallel engine keeps in flight: one per stage, or
    $EMBER_PIPELINE_STEPS_IN_FLIGHT (1: a step at a time, the stages taking turns; what
    benchmarks/tensor_parallel.py --pipeline compares)."""
    value = os.environ.get("EMBER_PIPELINE_STEPS_IN_FLIGHT", "").strip()
    if not value or num_stages == 1:
        return num_stages
    if not value.isdigit() or int(value) < 1:
        raise ValueError(
            f"EMBER_PIPELINE_STEPS_IN_FLIGHT must be a positive integer; got {value!r}"
        )
    return int(value)


def node_join_timeout() -> float:
    """Seconds the nodes of a model over several hosts wait for one another (the head's
    start, the other nodes' ranks): $EMBER_NODE_JOIN_TIMEOUT, default 600."""
    value = os.environ.get("EMBER_NODE_JOIN_TIMEOUT", "").strip() or "600"
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"EMBER_NODE_JOIN_TIMEOUT must be a positive number; got {value!r}")
    return seconds


def huge_pages() -> bool:
    """Whether the GGUF blocks decode steps stream, and a CPU KV pool, go into mappings of
    2 MB pages (ember.models.huge_pages, ember.kv.buffers): $EMBER_HUGE_PAGES, 1 (default)
    or 0."""
    value = os.environ.get("EMBER_HUGE_PAGES", "").strip() or "1"
    if value not in ("0", "1"):
        raise ValueError(f"EMBER_HUGE_PAGES must be 0 or 1; got {value!r}")
    return value == "1"


def matmul_split() -> str:
    """How a bf16 matmul chooses between oneDNN's whole call and ember's split by rows
    (ember.engine.matmul_split): $EMBER_MATMUL_SPLIT, "measure" (default: timed while
    idle, per shape and row count) or "rule" (a fixed rule, the same every start)."""
    value = os.environ.get("EMBER_MATMUL_SPLIT", "").strip() or "measure"
    if value not in ("measure", "rule"):
        raise ValueError(f"EMBER_MATMUL_SPLIT must be measure or rule; got {value!r}")
    return value

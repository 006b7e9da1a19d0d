"""From request records to numbers: the summary, the table, the JSON, the plot, comparisons.

Conventions follow `vllm bench serve`: TTFT is send -> first content chunk; TPOT is
(e2e - TTFT) / (output tokens - 1), so it excludes the first token; ITL are the gaps
between content chunks; goodput counts requests meeting every SLO given, per second.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from dataclasses import asdict

from ember.bench.serve import RequestRecord

PERCENTILES = (50, 90, 99)


def distribution(values: list[float]) -> dict:
    """mean and percentiles, in milliseconds."""
    if not values:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}}
    ms = sorted(v * 1e3 for v in values)
    out = {"mean": statistics.fmean(ms)}
    for q in PERCENTILES:
        out[f"p{q}"] = ms[min(len(ms) - 1, round(q / 100 * (len(ms) - 1)))]
    return out


def tpot(record: RequestRecord) -> float | None:
    if record.ttft is None or record.e2e is None or record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def summarize(records: list[RequestRecord], wall: float, slo: dict[str, float]) -> dict:
    ok = [r for r in records if r.error is None]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := tpot(r)) is not None]
    good = [r for r in ok if _meets(r, slo)]
    return {
        "duration_s": wall,
        "num_requests": len(records),
        "num_completed": len(ok),
        "num_sessions": len({r.session_id for r in records}),
        "num_turns": max((r.turn for r in records), default=-1) + 1,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "recomputed_prompt_tokens": prompt - cached,  # the servers computed (not cached)
        "output_tokens": output,
        "request_throughput": len(ok) / wall,
        "output_throughput": output / wall,
        "total_token_throughput": (prompt + output) / wall,
        "goodput": len(good) / wall if slo else None,
        "slo_ms": {k: v * 1e3 for k, v in slo.items()},
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([x for r in ok for x in r.itl]),
        "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None]),
        "per_turn": _per_turn(ok),
        "errors": dict(Counter(r.error for r in records if r.error is not None)),
    }


def _meets(record: RequestRecord, slo: dict[str, float]) -> bool:
    if "ttft" in slo and (record.ttft is None or record.ttft > slo["ttft"]):
        return False
    value = tpot(record)
    return not ("tpot" in slo and value is not None and value > slo["tpot"])


def _per_turn(records: list[RequestRecord]) -> list[dict]:
    turns: dict[int, list[RequestRecord]] = defaultdict(list)
    for record in records:
        turns[record.turn].append(record)
    out = []
    for turn, rs in sorted(turns.items()):
        ttft = distribution([r.ttft for r in rs if r.ttft is not None])
        out.append({
            "turn": turn,
            "count": len(rs),
            "ttft_ms_mean": ttft["mean"],
            "ttft_ms_p50": ttft["p50"],
            "ttft_ms_p90": ttft["p90"],
            "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in rs),
            "cached_tokens_mean": statistics.fmean(r.cached_tokens for r in rs),
            # prompt tokens the server computed: what an evicted or moved session costs
            "recomputed_tokens_mean": statistics.fmean(
                r.prompt_tokens - r.cached_tokens for r in rs
            ),
        })  # fmt: skip
    return out


def result_json(config: dict, summary: dict, records: list[RequestRecord]) -> dict:
    return {"config": config, "summary": summary, "requests": [asdict(r) for r in records]}


def print_summary(summary: dict) -> None:
    s = summary
    print(f"requests: {s['num_completed']}/{s['num_requests']} completed, "
          f"{s['num_sessions']} sessions, {s['num_turns']} turns, {s['duration_s']:.1f} s")  # fmt: skip
    print(f"throughput: {s['request_throughput']:.2f} req/s, "
          f"{s['output_throughput']:.1f} output tok/s, "
          f"{s['total_token_throughput']:.1f} total tok/s")  # fmt: skip
    if s["goodput"] is not None:
        print(f"goodput: {s['goodput']:.2f} req/s under SLO {s['slo_ms']} ms")
    print(f"cache hit ratio: {s['cache_hit_ratio']:.3f} "
          f"({s['cached_tokens']} of {s['prompt_tokens']} prompt tokens)")  # fmt: skip
    print(f"{'ms':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        d = s[f"{name}_ms"]
        cells = "".join(f"{d[k]:>10.1f}" if d[k] is not None else f"{'-':>10}"
                        for k in ("mean", "p50", "p90", "p99"))  # fmt: skip
        print(f"{name.upper():<6}{cells}")
    if s["num_turns"] > 1:
        print("turn  requests  prompt tokens  cached  recomputed  TTFT p50 / p90 (ms)")
        for t in s["per_turn"]:
            ttft = "/".join(f"{t[k]:.1f}" if t[k] is not None else "-"
                            for k in ("ttft_ms_p50", "ttft_ms_p90"))  # fmt: skip
            print(f"{t['turn']:<6}{t['count']:>8}{t['prompt_tokens_mean']:>15.1f}"
                  f"{t['cached_tokens_mean']:>8.1f}{t['recomputed_tokens_mean']:>12.1f}"
                  f"{ttft:>21}")  # fmt: skip
    if (spec := s.get("spec_decode")) is not None:
        print(f"speculative decoding: {spec['num_accepted_tokens']} of "
              f"{spec['num_draft_tokens']} draft tokens accepted "
              f"({spec['acceptance_rate']:.3f}), {spec['mean_accepted_length']:.2f} tokens per "
              f"verification, accepted per position {spec['accepted_per_position']}")  # fmt: skip
    if s["errors"]:
        print(f"errors: {s['errors']}")


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib (pip install 'ember[bench]')") from exc
    return plt


def plot_compare(names: list[str], runs: list[list[dict]], path: str) -> None:
    """TTFT and ITL CDFs of several runs (their JSON request lists), overlaid, in one PNG."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    lows = [[], []]  # per axis: a log scale (latencies span decades) needs values > 0
    for name, requests in zip(names, runs, strict=True):
        ok = [r for r in requests if r["error"] is None]
        ttft = sorted(r["ttft"] * 1e3 for r in ok if r["ttft"] is not None)
        itl = sorted(x * 1e3 for r in ok for x in r["itl"])
        for i, values in enumerate((ttft, itl)):
            lows[i].append(min(values, default=0))
        for ax, values in ((axes[0], ttft), (axes[1], itl)):
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))],
                    where="post", label=name)  # fmt: skip
    for ax, title, low in zip(axes, ("TTFT", "inter-token latency"), lows, strict=True):
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel="share", ylim=(0, 1.02))
        ax.set_xscale("log" if min(low) > 0 else "linear")
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot(summary: dict, records: list[RequestRecord], path: str) -> None:
    """TTFT and ITL CDFs, and TTFT by turn, in one PNG."""
    plt = _pyplot()
    ok = [r for r in records if r.error is None]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    cdfs = (
        ([r.ttft * 1e3 for r in ok if r.ttft is not None], "TTFT", "share of requests"),
        ([x * 1e3 for r in ok for x in r.itl], "inter-token latency", "share of gaps"),
    )
    for ax, (values, title, ylabel) in zip(axes, cdfs, strict=False):
        values = sorted(values)
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post")
        ax.set(title=f"{title} CDF", xlabel="ms", ylabel=ylabel, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    _plot_turns(axes[2], [t for t in summary["per_turn"] if t["ttft_ms_mean"] is not None])
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_turns(ax, turns: list[dict]) -> None:
    from matplotlib.ticker import MaxNLocator

    x = [t["turn"] for t in turns]
    (ttft,) = ax.plot(x, [t["ttft_ms_mean"] for t in turns], "o-", label="TTFT mean (ms)")
    ax.set(title="TTFT by turn", xlabel="turn", ylabel="ms")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    twin = ax.twinx()
    (prompt,) = twin.plot(
        x, [t["prompt_tokens_mean"] for t in turns], "s--", color="tab:orange",
        label="prompt tokens (mean)",
    )  # fmt: skip
    twin.set_ylabel("prompt tokens")
    ax.legend(handles=[ttft, prompt], loc="best")


COMPARE_ROWS = [
    ("requests completed", ("num_completed",)),
    ("req/s", ("request_throughput",)),
    ("output tok/s", ("output_throughput",)),
    ("goodput req/s", ("goodput",)),
    ("cache hit ratio", ("cache_hit_ratio",)),
    ("TTFT mean ms", ("ttft_ms", "mean")),
    ("TTFT p90 ms", ("ttft_ms", "p90")),
    ("TPOT mean ms", ("tpot_ms", "mean")),
    ("TPOT p90 ms", ("tpot_ms", "p90")),
    ("ITL p90 ms", ("itl_ms", "p90")),
    ("E2E p90 ms", ("e2e_ms", "p90")),
]


def compare_table(names: list[str], summaries: list[dict]) -> str:
    """Rows of metrics, a column per run, and each later run's ratio to the first."""
    head = ["metric", *names, *(f"{n} / {names[0]}" for n in names[1:])]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for label, keys in COMPARE_ROWS:
        values = [_get(s, keys) for s in summaries]
        cells = [_fmt(v) for v in values]
        base = values[0]
        ratios = [_fmt(v / base) + "x" if v is not None and base else "-" for v in values[1:]]
        lines.append(" | ".join([label, *cells, *ratios]))
    return "\n".join(lines)


def _get(summary: dict, keys: tuple[str, ...]):
    value = summary
    for key in keys:
        value = value.get(key) if isinstance(value, dict) else None
    return value


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return str(value)
    return f"{value:.3f}" if isinstance(value, float) and abs(value) < 10 else f"{value:.1f}"

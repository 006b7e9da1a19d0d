"""The `ember bench` commands' arguments, and the entry points of `serve` and `compare`
(`offline` runs in `offline.py`, `startup` in `startup.py`). Light: `ember serve` builds
the whole command line before it starts its engine core."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from ember import envs


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server address, e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--api-key", default=None, help="default: $EMBER_API_KEY")
    p.add_argument("--workload", choices=["random", "agentic", "trace"], default="random")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    p.add_argument("--request-rate", type=float, default=0.0,
                   help="Poisson arrivals per second of requests / sessions (0: all at once)")  # fmt: skip
    p.add_argument("--duration", type=float, default=None, help="stop sending after S seconds")
    p.add_argument("--num-requests", type=int, default=32, help="random and trace workloads")
    p.add_argument("--input-len", default="256", help="prompt tokens: N or LO:HI (random)")
    p.add_argument("--output-len", default="64", help="output tokens: N or LO:HI")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let the model stop early (default: ask for ignore_eos)")  # fmt: skip
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--num-sessions", type=int, default=4, help="agentic: sessions")
    p.add_argument("--num-turns", type=int, default=4, help="agentic: turns per session")
    p.add_argument("--system-tokens", type=int, default=256, help="agentic: system prompt")
    p.add_argument("--num-tools", type=int, default=2, help="agentic: tool definitions")
    p.add_argument("--tool-tokens", type=int, default=32, help="agentic: per tool description")
    p.add_argument("--turn-tokens", type=int, default=32, help="agentic: each new message")
    p.add_argument("--session-context-tokens", type=int, default=0,
                   help="agentic: each session's own context at the start of its first "
                        "message, after the system prompt (default 0)")  # fmt: skip
    p.add_argument("--quote-tokens", type=int, default=0,
                   help="agentic: each message also asks for this many tokens of the "
                        "session's context back verbatim (replies that quote their context, "
                        "as code edits and tool arguments do; default 0)")  # fmt: skip
    p.add_argument("--prefix-sharing", choices=["shared", "per-session"], default="shared",
                   help="agentic: system prompt and tools shared by all sessions or not")  # fmt: skip
    p.add_argument("--no-session-header", dest="session_header", action="store_false",
                   help="agentic: send no x-session-affinity (routers place by prefix)")  # fmt: skip
    p.add_argument("--think-time", type=float, default=0.0, help="agentic: seconds between turns")
    p.add_argument("--trace", default=None, help="trace: Mooncake-format JSONL file")
    p.add_argument("--trace-start", type=int, default=0, help="trace: first line replayed")
    p.add_argument("--trace-block-tokens", type=int, default=32,
                   help="trace: tokens per hash id (the trace's blocks are 512)")  # fmt: skip
    p.add_argument("--trace-output-scale", type=float, default=None,
                   help="trace: output length factor (default: block tokens / 512)")  # fmt: skip
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="trace: factor on timestamps (0: ignore them, send asap)")  # fmt: skip
    p.add_argument("--slo", default=None, help="goodput SLOs, e.g. ttft=500,tpot=50 (ms)")
    p.add_argument("--tokenizer", default=None,
                   help="model whose tokenizer sizes the text (default: smollm2-135m)")  # fmt: skip
    p.add_argument("--extra-body", default="{}", help="JSON merged into every request")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", default=None, help="write the full result as JSON")
    p.add_argument("--plot", default=None, help="draw TTFT/ITL CDFs and TTFT by turn (PNG)")
    p.add_argument("--no-progress", action="store_true")


def add_offline_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: all cores)"
    )
    parser.add_argument("--compare-hf", action="store_true", help="also time transformers.generate")
    parser.add_argument("--skip-throughput", action="store_true", help="only latency scenarios")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each latency scenario")
    parser.add_argument("--out", default=None, help="write the results as JSON here")


def add_startup_args(parser: argparse.ArgumentParser) -> None:
    from ember.engine_args import add_model_arg

    add_model_arg(parser)
    parser.add_argument(
        "--port", type=int, default=0, help="port for `ember serve` (default: a free one per run)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="cold starts to time (default 3)")
    parser.add_argument(
        "--warm",
        action="store_true",
        help="leave the weights in the page cache (default: evict them before each run, "
        "posix_fadvise DONTNEED)",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra argument for `ember serve` (repeatable), e.g. --serve-arg=--kv-cache-memory=64M",
    )


def parse_slo(text: str | None) -> dict[str, float]:
    """`ttft=500,tpot=50` (ms) -> {"ttft": 0.5, "tpot": 0.05} (seconds)."""
    slo = {}
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, _, value = part.partition("=")
        if key.strip() not in ("ttft", "tpot") or not value:
            raise ValueError(f"--slo: expected ttft=MS,tpot=MS, got {part!r}")
        slo[key.strip()] = float(value) / 1e3
    return slo


def _check(args) -> None:
    if args.workload == "trace" and not args.trace:
        raise ValueError("--workload trace needs --trace FILE")
    if args.session_context_tokens < 0:
        raise ValueError("--session-context-tokens must be >= 0")
    if args.trace_output_scale is None:
        args.trace_output_scale = args.trace_block_tokens / 512
    args.api_key = args.api_key or envs.api_key()
    json.loads(args.extra_body)


def _server_model(args) -> str:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    import httpx

    response = httpx.get(f"{args.url.rstrip('/')}/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    return response.json()["data"][0]["id"]


SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def spec_counters(args) -> dict | None:
    """Speculative decoding's counters from the server's /load (a router's: summed over
    its workers' last reports); None where it does not speculate or does not say."""
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        load = httpx.get(f"{args.url.rstrip('/')}/load", headers=headers, timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return None
    reports = [w.get("reported") or {} for w in load["workers"]] if "workers" in load else [load]
    specs = [r["spec_decode"] for r in reports if r.get("spec_decode")]
    if not specs:
        return None
    total = {k: sum(s[k] for s in specs) for k in SPEC_COUNTERS}
    width = max(len(s["accepted_per_position"]) for s in specs)
    total["accepted_per_position"] = [
        sum(s["accepted_per_position"][i] for s in specs if i < len(s["accepted_per_position"]))
        for i in range(width)
    ]
    return total


def spec_summary(before: dict | None, after: dict | None) -> dict | None:
    """What the run's drafts did: the counters' growth, the share of draft tokens
    accepted, and the mean tokens per verification (accepted drafts + the target's own)."""
    if after is None:
        return None
    before = before or {k: 0 for k in SPEC_COUNTERS} | {"accepted_per_position": []}
    out = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    old = before["accepted_per_position"]
    out["accepted_per_position"] = [
        n - (old[i] if i < len(old) else 0) for i, n in enumerate(after["accepted_per_position"])
    ]
    out["acceptance_rate"] = out["num_accepted_tokens"] / max(out["num_draft_tokens"], 1)
    out["mean_accepted_length"] = 1 + out["num_accepted_tokens"] / max(out["num_drafts"], 1)
    return out


def run_serve(args) -> int:
    from ember.bench.report import plot, print_summary, result_json, summarize
    from ember.bench.serve import LoadGenerator
    from ember.bench.workloads import WordSource, build_workload
    from ember.loader.checkpoint import open_checkpoint
    from ember.loader.default_models import resolve_model

    _check(args)
    slo = parse_slo(args.slo)
    args.model = args.model or _server_model(args)
    words = WordSource(open_checkpoint(resolve_model(args.tokenizer)).tokenizer(), args.seed)
    sessions = build_workload(words, args)
    generator = LoadGenerator(args, sessions, words)
    spec_before = spec_counters(args)
    wall = asyncio.run(generator.run())
    records = sorted(generator.records, key=lambda r: r.start)
    summary = summarize(records, wall, slo)
    summary["spec_decode"] = spec_summary(spec_before, spec_counters(args))
    print_summary(summary)
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["started_at"] = generator.started_at  # the records' `start` counts from here
    if args.out:
        Path(args.out).write_text(json.dumps(result_json(config, summary, records), indent=1))
    if args.plot:
        plot(summary, records, args.plot)
    return 0


def add_compare_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="JSON files written by ember bench serve --out")
    p.add_argument("--names", default=None, help="comma-separated column names")
    p.add_argument("--plot", default=None, help="overlay their TTFT and ITL CDFs (PNG)")


def run_compare(args) -> int:
    from ember.bench.report import compare_table

    results = [json.loads(Path(f).read_text()) for f in args.results]
    names = args.names.split(",") if args.names else [Path(f).stem for f in args.results]
    if len(names) != len(results):
        raise ValueError("--names: one name per result file")
    print(compare_table(names, [r["summary"] for r in results]))
    if args.plot:
        from ember.bench.report import plot_compare

        plot_compare(names, [r["requests"] for r in results], args.plot)
    return 0

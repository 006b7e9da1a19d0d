"""`ember plan` and `ember plan profile`: their arguments and what they print."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from pathlib import Path

from ember import envs


def _profile_args(p: argparse.ArgumentParser, model_flag: bool) -> None:
    from ember import plan as profile

    if model_flag:
        p.add_argument("--model", default=None,
                       help="the model to profile on this machine (default: smollm2-135m)")  # fmt: skip
    else:
        p.add_argument("model", nargs="?", default=None,
                       help="the model to profile on this machine (default: smollm2-135m)")  # fmt: skip
    p.add_argument("--cores", type=int, default=None,
                   help="profile on this many of this machine's cores (as `ember up --pin` "
                        "gives each worker its share; default: all)")  # fmt: skip
    p.add_argument("--serve-args", default="",
                   help="more `ember serve` flags for the profiled worker, one string")  # fmt: skip
    p.add_argument("--lengths", type=int, nargs="+", default=list(profile.PREFILL_LENGTHS),
                   help="prompt lengths of the prefill probes")  # fmt: skip
    p.add_argument("--batches", type=int, nargs="+", default=list(profile.DECODE_BATCHES),
                   help="batch sizes of the decode probes")  # fmt: skip
    p.add_argument("--contexts", type=int, nargs="+", default=list(profile.DECODE_CONTEXTS),
                   help="prompt lengths of the decode probes")  # fmt: skip
    p.add_argument("--decode-tokens", type=int, default=48, help="tokens each decode probe makes")
    p.add_argument("--repeats", type=int, default=3, help="runs of each prefill probe")
    p.add_argument("--max-context-tokens", type=int, default=16384,
                   help="decode probes whose prompts pass this in all are left out")  # fmt: skip
    p.add_argument("--no-progress", action="store_true")


def add_plan_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="plan_command")
    prof = sub.add_parser(
        "profile", help="measure one worker (a running one at --url, or one started here)"
    )
    _profile_args(prof, model_flag=False)
    prof.add_argument("--url", default=None, help="a running worker (default: start one here)")
    prof.add_argument("--api-key", default=None, help="default: $EMBER_API_KEY")
    prof.add_argument("--machine", default=None,
                      help="with --url: what the worker runs on (its CPU or GPU), for the record")  # fmt: skip
    prof.add_argument("--out", default=None, help="write the profile here (default: stdout)")
    prof.set_defaults(func=run_profile)

    p.add_argument("--trace", help="Mooncake-format JSONL, or an `ember bench serve --out` JSON")
    p.add_argument("--slo", help="targets for the p90s, e.g. ttft=2000,itl=100 (ms)")
    p.add_argument("--profile", default=None,
                   help="a worker profile (`ember plan profile --out`); default: profile the "
                        "model on this machine first")  # fmt: skip
    p.add_argument("--save-profile", default=None, help="keep the profile taken here")
    p.add_argument("--max-workers", type=int, default=16, help="the largest cluster considered")
    p.add_argument("--kv-gbps", type=float, default=2.0,
                   help="KV hand-off bandwidth between prefill and decode workers, GB/s "
                        "(default 2: ember's TCP transport on one host)")  # fmt: skip
    p.add_argument("--trace-start", type=int, default=0, help="first line of a JSONL trace")
    p.add_argument("--num-requests", type=int, default=None, help="requests of the trace used")
    p.add_argument("--trace-block-tokens", type=int, default=32,
                   help="tokens per hash id (the trace's blocks are 512), as ember bench")  # fmt: skip
    p.add_argument("--trace-output-scale", type=float, default=None,
                   help="output length factor (default: block tokens / 512), as ember bench")  # fmt: skip
    p.add_argument("--time-scale", type=float, default=1.0, help="factor on timestamps")
    p.add_argument("--json", default=None, help="also write the plan as JSON here")
    _profile_args(p, model_flag=True)
    p.set_defaults(func=run_plan)


def _probe_options(args) -> dict:
    return dict(
        lengths=args.lengths, batches=args.batches, contexts=args.contexts,
        decode_tokens=args.decode_tokens, repeats=args.repeats,
        max_context_tokens=args.max_context_tokens, progress=not args.no_progress,
    )  # fmt: skip


def _profile_here(args, model):
    from ember.plan.profile import profile_here

    return profile_here(model, shlex.split(args.serve_args), args.cores, **_probe_options(args))


def run_profile(args) -> int:
    from ember.plan.profile import measure

    if args.url:
        if args.cores is not None or args.serve_args or args.model:
            raise ValueError("--url profiles a running worker: MODEL, --cores and "
                             "--serve-args are for one started here")  # fmt: skip
        key = args.api_key or envs.api_key()
        options = _probe_options(args)
        profile = asyncio.run(measure(args.url, api_key=key, host=args.machine, **options))
    else:
        if args.machine:
            raise ValueError("--machine names a worker at --url; one started here is "
                             "described by itself")  # fmt: skip
        profile = _profile_here(args, args.model)
    if args.out:
        Path(args.out).write_text(profile.to_json())
        print(f"profile written to {args.out}")
    else:
        print(profile.to_json())
    return 0


def run_plan(args) -> int:
    from ember.plan.demand import load_trace
    from ember.plan.model import parse_slo, plan
    from ember.plan.profile import WorkerProfile

    if not args.trace or not args.slo:
        raise ValueError("ember plan needs --trace FILE and --slo ttft=MS,itl=MS "
                         "(or `ember plan profile` to measure a worker)")  # fmt: skip
    slo = parse_slo(args.slo)
    demand = load_trace(
        args.trace, args.trace_start, args.num_requests, args.trace_block_tokens,
        args.trace_output_scale, args.time_scale,
    )  # fmt: skip
    if args.profile:
        profile = WorkerProfile.load(args.profile)
    else:
        print("no --profile: profiling the model on this machine first")
        profile = _profile_here(args, args.model)
        if args.save_profile:
            Path(args.save_profile).write_text(profile.to_json())
    result = plan(profile, demand, slo, args.max_workers, args.kv_gbps)
    print_plan(profile, demand, slo, result)
    if args.json:
        Path(args.json).write_text(json.dumps(plan_json(profile, demand, slo, result), indent=1))
    return 0 if result.best is not None else 1


def plan_json(profile, demand, slo, result) -> dict:
    def one(prediction):
        return None if prediction is None else prediction.as_dict()

    return {
        "profile": {"model": profile.model, "machine": profile.machine,
                    "coefficients": profile.coefficients},
        "demand": demand.summary(), "slo_ms": slo,
        "recommended": one(result.best), "engine_flags": engine_flags(profile),
        "disaggregated": one(result.disaggregated),
        "mixed": one(result.mixed),
        "considered": [p.as_dict() for p in result.considered],
    }  # fmt: skip


def print_plan(profile, demand, slo, result) -> None:
    d = demand.summary()
    print(f"worker: {profile.model} on {profile.machine}")
    print(f"trace: {d['requests']} requests over {d['span_s']} s ({d['rate_per_s']} req/s); "
          f"prompt {d['mean_prompt_tokens']} tokens ({d['mean_new_tokens']} not cached), "
          f"output {d['mean_output_tokens']}")  # fmt: skip
    print(f"SLO (p90): {', '.join(f'{k} {v:g} ms' for k, v in slo.items())}")
    print(f"{'ms':<16}{'workers':>8}{'TTFT mean':>11}{'TTFT p90':>10}{'ITL mean':>10}"
          f"{'ITL p90':>9}  utilisation")  # fmt: skip
    for name, prediction in (("disaggregated", result.disaggregated), ("mixed", result.mixed)):
        if prediction is None:
            print(f"{name:<16}   none of up to {max(p.workers for p in result.considered)} "
                  f"workers meets the SLO")  # fmt: skip
            continue
        p = prediction
        split = f"{p.prefill}P+{p.decode}D" if p.mode == "disaggregated" else f"{p.mixed}M"
        busy = ", ".join(f"{k} {v:.0%}" for k, v in p.utilization.items())
        print(f"{name:<16}{split:>8}{p.ttft_ms:>11.0f}{p.ttft_p90_ms:>10.0f}{p.itl_ms:>10.1f}"
              f"{p.itl_p90_ms:>9.1f}  {busy}")  # fmt: skip
    best = result.best
    if best is None:
        print("no configuration meets the SLO: loosen it, raise --max-workers, or profile "
              "a faster worker")  # fmt: skip
        return
    other = result.mixed if best.mode == "disaggregated" else result.disaggregated
    verdict = ("disaggregation pays" if best.mode == "disaggregated" else
               "disaggregation does not pay here")  # fmt: skip
    if other is not None and other.workers == best.workers:
        verdict += " (the same number of workers either way; the lower p90s decide)"
    print(f"recommended: {' '.join([best.command(), *engine_flags(profile)])}   ({verdict})")


def engine_flags(profile) -> list[str]:
    """The profiled worker's step limits, where they are not the defaults: the predictions
    hold for workers run with them."""
    from ember.plan.profile import ENGINE

    flags = []
    if profile.max_num_batched_tokens != ENGINE.max_num_batched_tokens:
        flags += ["--max-num-batched-tokens", str(profile.max_num_batched_tokens)]
    if profile.max_step_ms != ENGINE.max_step_ms:
        flags += ["--max-step-ms", f"{profile.max_step_ms:g}"]
    if not profile.target_itl_auto:  # (auto is the default)
        flags += ["--target-itl-ms", f"{profile.target_itl_ms:g}"]
    return flags

"""`ember plan` against what its recommendation does: profile, plan, run it, compare.

    python benchmarks/plan_check.py [--model M] [--trace FILE] [--num-requests 40]
        [--time-scale 4] [--slo ttft=3000,itl=300] [--max-workers 2] [--profile FILE]

1. `ember plan profile` of the model on one core of this machine (what each of two
   workers gets under `ember up --pin`), unless --profile gives one;
2. `ember plan` on the trace's first --num-requests requests (shaped as `ember bench
   serve --workload trace` replays them: --trace-block-tokens, --trace-output-scale,
   --time-scale) for --slo with at most --max-workers workers;
3. the recommended `ember up ... --pin`, and `ember bench serve --workload trace` on it
   with the same shaping; then each configuration named with --also (e.g. "--mixed 2")
   the same way, against its own prediction;
4. predicted against measured TTFT and ITL (mean and p90) for each, and their ratio.
Prints a table and writes everything to --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "mooncake-synthetic_trace.jsonl"


def ember(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ember.cli", *args], check=True, **kwargs)


def shaping(args) -> list[str]:
    out = ["--num-requests", str(args.num_requests), "--trace-block-tokens",
           str(args.trace_block_tokens), "--time-scale", str(args.time_scale)]  # fmt: skip
    if args.trace_output_scale is not None:
        out += ["--trace-output-scale", str(args.trace_output_scale)]
    return out


def run_cluster(args, split: list[str], work: Path, name: str) -> dict:
    """`ember up SPLIT --pin` and the trace replayed against it: the bench summary."""
    port = 8741
    model = [args.model] if args.model else []
    command = [sys.executable, "-m", "ember.cli", "up", *model, *split, "--pin",
               "--port", str(port), "--worker-port", str(port + 1), *shlex.split(args.up_args)]  # fmt: skip
    env = dict(os.environ, EMBER_LOG_LEVEL="WARNING")
    up = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = up.stdout.readline()
        if "/v1" not in line:
            raise RuntimeError(f"ember up did not come up: {line!r}")
        url = f"http://127.0.0.1:{port}"
        while not all(w["healthy"] for w in httpx.get(f"{url}/load", timeout=5).json()["workers"]):
            time.sleep(0.5)
        out = work / f"bench-{name}.json"
        ember("bench", "serve", "--url", url, "--workload", "trace", "--trace", args.trace,
              *shaping(args), "--out", str(out), "--no-progress",
              stdout=subprocess.DEVNULL)  # fmt: skip
        return json.loads(out.read_text())["summary"]
    finally:
        up.terminate()
        up.wait(timeout=60)


def compare(predicted: dict, measured: dict) -> dict:
    rows = {}
    for key, (pred_key, dist) in {
        "ttft_mean": ("ttft_ms", ("ttft_ms", "mean")),
        "ttft_p90": ("ttft_p90_ms", ("ttft_ms", "p90")),
        "itl_mean": ("itl_ms", ("itl_ms", "mean")),
        "itl_p90": ("itl_p90_ms", ("itl_ms", "p90")),
    }.items():
        want, got = predicted[pred_key], measured[dist[0]][dist[1]]
        rows[key] = {"predicted": want, "measured": round(got, 1),
                     "measured_over_predicted": round(got / want, 2) if want else None}  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--trace", default=str(TRACE))
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--trace-block-tokens", type=int, default=16)
    parser.add_argument("--trace-output-scale", type=float, default=0.25)
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--slo", default="ttft=3000,itl=300")
    parser.add_argument("--max-workers", type=int, default=2)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--also", action="append", default=[],
                        help="another split to run and compare, e.g. '--mixed 2'")  # fmt: skip
    parser.add_argument("--up-args", default="--kv-cache-memory 1G",
                        help="more `ember up` flags, one string")  # fmt: skip
    parser.add_argument("--out", default="plan_check.json")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="ember-plan-"))
    profile = args.profile
    if profile is None:
        profile = str(work / "profile.json")
        ember("plan", "profile", *([args.model] if args.model else []), "--cores", "1",
              "--serve-args", args.up_args, "--out", profile)  # fmt: skip
    plan_file = work / "plan.json"
    ember("plan", "--trace", args.trace, *shaping(args), "--slo", args.slo, "--profile", profile,
          "--max-workers", str(args.max_workers), "--json", str(plan_file))  # fmt: skip
    planned = json.loads(plan_file.read_text())
    best = planned["recommended"]
    runs = [(best["command"].split()[2:], best)]
    for split in args.also:
        words = split.split()
        want = next(p for p in planned["considered"]
                    if p["command"].split()[2:] == words)  # fmt: skip
        runs.append((words, want))
    results = []
    for split, predicted in runs:
        name = "-".join(s.strip("-") for s in split)
        measured = run_cluster(args, split, work, name)
        row = {"split": " ".join(split), "compare": compare(predicted, measured),
               "measured_summary": {k: measured[k] for k in ("num_completed", "num_requests",
                                    "output_throughput", "cache_hit_ratio")}}  # fmt: skip
        results.append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"plan": planned, "runs": results}, indent=1))


if __name__ == "__main__":
    main()

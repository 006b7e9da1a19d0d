"""Agent sessions on 2 workers behind the router; halfway through, worker 0 is killed
(SIGKILL). `--event restart`: `ember up` starts it again, and with the tiers on it has
its disk tier (`--kv-disk-dir`) back; `--event remove`: it stays down, and with the tiers
on its sessions' next turns load their prefixes from the shared Mooncake Store on worker 1.
The same run with the tiers off is the baseline. Reports, for the sessions whose home was
worker 0, the TTFT of their first turn after the kill against their previous turn.

    python benchmarks/kv_tiers_moves.py HF_DIR --event restart|remove [--rounds N]

Runs itself inside a loopback-only network namespace (Mooncake listens on every
interface). The workload is benchmarks/kv_tiers_ab.sh's: 32 sessions x 6 turns, a
512-token system prompt each, 64 new tokens and 32 output tokens a turn, 1 s think time,
4 in flight. "Halfway" is when the router has placed half of the requests. Each run's
records: /tmp/tiers-moves/<event>-<round>-<side>.json; one summary line per run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from ember.router.policy import Router  # noqa: E402

OUT = Path("/tmp/tiers-moves")
SESSIONS, TURNS = 32, 6
COMMON = ["--mixed", "2", "--pin", "--kv-cache-memory", "80M", "--max-model-len", "1536",
          "--matmul-precision", "bf16"]  # fmt: skip
TIERS = {
    "restart": ["--kv-offload-memory", "512M", "--kv-disk-dir", str(OUT / "disk")],
    "remove": ["--kv-offload-memory", "512M", "--kv-store", "mooncake",
               "--kv-store-memory", "3G"],
}  # fmt: skip
WORKLOAD = ["--workload", "agentic", "--num-sessions", str(SESSIONS), "--num-turns", str(TURNS),
            "--system-tokens", "512", "--num-tools", "0", "--turn-tokens", "64",
            "--output-len", "32", "--prefix-sharing", "per-session", "--think-time", "1",
            "--max-concurrency", "4"]  # fmt: skip


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


def wait_until(check, timeout: float, step: float = 0.3) -> float | None:
    """The time.time() at which `check()` first held, or None at timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return time.time()
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(step)
    return None


def run(args, event: str, side: str, round_: int) -> dict:
    port, worker_port = 8800, 8810
    urls = [f"http://127.0.0.1:{worker_port + i}" for i in range(2)]
    shutil.rmtree(OUT / "disk", ignore_errors=True)
    restarts = "5" if event == "restart" else "0"
    command = [sys.executable, "-m", "ember.cli", "up", args.hf_dir, "--port", str(port),
               "--worker-port", str(worker_port), "--worker-restarts", restarts, *COMMON,
               *(TIERS[event] if side == "on" else [])]  # fmt: skip
    env = dict(os.environ, EMBER_LOG_LEVEL="WARNING", MC_LOG_LEVEL="ERROR")
    name = f"{event}-{round_}-{side}"
    with open(OUT / f"{name}.log", "w") as log:
        up = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        router = f"http://127.0.0.1:{port}"
        if wait_until(lambda: httpx.get(f"{router}/health").json()["workers"] == 2, 900) is None:
            raise RuntimeError(f"{name}: the cluster did not come up (see {name}.log)")
        out = OUT / f"{name}.json"
        bench = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "bench", "serve", "--url", router, *WORKLOAD,
             "--tokenizer", args.hf_dir, "--seed", str(round_), "--no-progress", "--out",
             str(out)], stdout=subprocess.DEVNULL, env=env,
        )  # fmt: skip

        def placed() -> int:
            return sum(httpx.get(f"{router}/load").json()["decisions"].values())

        half = SESSIONS * TURNS // 2
        wait_until(lambda: placed() >= half or bench.poll() is not None, 3600, 0.1)
        flag = b"--port\0%d\0" % worker_port
        (pid,) = [p for p in children(up.pid)
                  if flag in Path(f"/proc/{p}/cmdline").read_bytes()]  # fmt: skip
        os.kill(pid, signal.SIGKILL)
        killed_at = time.time()
        back_at = None
        if event == "restart":
            back_at = wait_until(
                lambda: any(w["url"] == urls[0] and w["healthy"] and pid not in children(up.pid)
                            for w in httpx.get(f"{router}/load").json()["workers"])
                and httpx.get(f"{urls[0]}/health").status_code == 200, 600)  # fmt: skip
        if bench.wait() != 0:
            raise RuntimeError(f"{name}: ember bench failed")
    finally:
        up.send_signal(signal.SIGTERM)
        up.wait(120)
    times = {"urls": urls, "killed_at": killed_at, "back_at": back_at}
    (OUT / f"{name}.event.json").write_text(json.dumps(times))
    return analyse(json.loads(out.read_text()), urls, killed_at, back_at)


def analyse(result: dict, urls: list[str], killed_at: float, back_at: float | None) -> dict:
    start = result["config"]["started_at"]
    kill, back = killed_at - start, (back_at - start if back_at else None)
    records = result["requests"]
    by_turn = {(r["session_id"], r["turn"]): r for r in records}
    ring = Router(urls)
    sessions = sorted({r["session_id"] for r in records})
    home = {s: ring._ring_order(s, ring.workers)[0].url for s in sessions}
    for r in sorted(records, key=lambda r: r["start"]):  # where it was served last (the
        if r.get("worker") and r["start"] < kill:  # router names it) before the kill
            home[r["session_id"]] = r["worker"]
    moved, stayed = [], []  # (first turn after the kill, the turn before) by session home
    for session in sessions:
        after = sorted((r for r in records if r["session_id"] == session and r["start"] >= kill),
                       key=lambda r: r["turn"])  # fmt: skip
        if after and after[0]["turn"] > 0 and after[0]["ttft"] is not None:
            previous = by_turn.get((session, after[0]["turn"] - 1))
            if previous and previous["ttft"] is not None:
                (moved if home[session] == urls[0] else stayed).append((after[0], previous))

    def group(pairs):
        if not pairs:
            return {"n": 0}
        return {
            "n": len(pairs),
            "ttft_ms_p50": round(statistics.median(r["ttft"] for r, _ in pairs) * 1000),
            "previous_ttft_ms_p50": round(statistics.median(p["ttft"] for _, p in pairs) * 1000),
            "ratio_p50": round(statistics.median(r["ttft"] / p["ttft"] for r, p in pairs), 2),
            "cached_share": round(sum(r["cached_tokens"] for r, _ in pairs)
                                  / max(sum(r["prompt_tokens"] for r, _ in pairs), 1), 3),
        }  # fmt: skip

    summary = result["summary"]
    report = {
        "killed_at_s": round(kill, 1),
        "back_at_s": round(back, 1) if back is not None else None,
        "moved": group(moved),
        "stayed": group(stayed),  # worker 1's own sessions: what the lost capacity costs
        "errors": summary["errors"],
        "hit_ratio": summary["cache_hit_ratio"],
        "ttft_ms_p50_p90": (summary["ttft_ms"]["p50"], summary["ttft_ms"]["p90"]),
        "wall_s": summary["duration_s"],
    }
    if back is not None:  # while it was down (on worker 1) and once it was back (home)
        report["moved_while_down"] = group([m for m in moved if m[0].get("worker") != urls[0]])
        report["moved_once_back"] = group([m for m in moved if m[0].get("worker") == urls[0]])
    return report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir")
    parser.add_argument("--event", choices=["restart", "remove"], required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--sides", default="off,on")
    args = parser.parse_args()
    args.hf_dir = str(Path(args.hf_dir).resolve())
    if not os.environ.get("EMBER_NETNS"):
        script = f"ip link set lo up && EMBER_NETNS=1 exec {sys.executable} {' '.join(sys.argv)}"
        return subprocess.call(["unshare", "-rn", "sh", "-c", script])
    OUT.mkdir(parents=True, exist_ok=True)
    sides = args.sides.split(",")
    for round_ in range(1, args.rounds + 1):
        for side in sides if round_ % 2 else sides[::-1]:  # the order alternates
            report = run(args, args.event, side, round_)
            print(args.event, round_, side, json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`ember bench startup`: where the seconds of a cold start of `ember serve` go.

What it measures, for one model:
- the weight bytes a start has to read (the checkpoint's safetensors shards or .gguf file);
- the disk's sequential read speed on those same files (page cache evicted, read once
  with a 16 MiB buffer), hence `disk_read_s`: the least time any start could take to read
  the weights once;
- per run, from the spawn: `ready_s` until GET /health answers 200, `first_chat_s` until
  the answer to a first chat completion (max_tokens=1) has arrived, and `cpu_s`, the CPU
  seconds the server's two processes used from spawn to exit (a number that other load
  on the machine barely moves, unlike the wall clock);
- per run, the server's own start-up phases (`ember.startup`, read from its /metrics):
  for each process and phase, when it ended (seconds since the server process began)
  and the CPU seconds that process had used by then;
- `startup_over_disk`: the median first_chat_s over disk_read_s (1.0 would be a start
  bounded by the disk alone).

Life cycle of a run:

    evict the weight files from the page cache (skipped with --warm)
    -> an HTTP client (made before t0: none of its time is the server's)
    -> t0 -> spawn `python -m ember.cli serve MODEL --port P ...` (its own session)
    -> poll /health every 50 ms until 200
    -> POST /v1/chat/completions (max_tokens=1) -> answer -> GET /metrics (the phases)
    -> SIGTERM; wait (SIGKILL to its group after 60 s)

Only the weights are evicted: Python, torch and ember's own files stay cached, as they
would on a machine that serves more than once. Eviction is posix_fadvise(DONTNEED),
which some containers ignore; the report says whether it was attempted, not whether the
kernel obliged (a disk "read speed" far above the device's hints that it did not).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

READ_BUFFER_BYTES = 16 << 20
HEALTH_POLL_S = 0.05
HEALTH_TIMEOUT_S = 1.0
STARTUP_TIMEOUT_S = 600.0
REQUEST_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 60.0
STDERR_TAIL_BYTES = 4000
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 1}
PHASE_METRICS = {"ember_startup_seconds": "at_s", "ember_startup_cpu_seconds": "cpu_s"}


def evict(files: list[Path]) -> bool:
    """Asks the kernel to drop `files` from the page cache; False if it refused.

    Dirty pages are not dropped by DONTNEED, so a file written moments ago (a model just
    fetched) is flushed first."""
    try:
        for file in files:
            fd = os.open(file, os.O_RDONLY)
            try:
                with contextlib.suppress(OSError):
                    os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    except OSError:
        return False
    return True


def disk_read_bytes_per_s(files: list[Path]) -> float:
    """Sequential read speed over `files`, read whole once after evicting them."""
    evict(files)
    buffer = memoryview(bytearray(READ_BUFFER_BYTES))
    total = 0
    start = time.perf_counter()
    for file in files:
        with open(file, "rb", buffering=0) as f:
            while n := f.readinto(buffer):
                total += n
    seconds = time.perf_counter() - start
    return total / max(seconds, 1e-9)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_server(path: Path, port: int, serve_args: list[str], log: IO[bytes]) -> subprocess.Popen:
    env = dict(os.environ, EMBER_LOG_LEVEL="WARNING")
    env.pop("EMBER_API_KEY", None)  # the bench sends no key
    command = [sys.executable, "-m", "ember.cli", "serve", str(path), "--port", str(port)]
    return subprocess.Popen(
        [*command, *serve_args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its engine core shares the group: one killpg ends both
    )


def _exit_error(
    process: subprocess.Popen, log: IO[bytes], what: str, name: str = "ember serve"
) -> RuntimeError:
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - STDERR_TAIL_BYTES))
    tail = log.read().decode(errors="replace")
    return RuntimeError(f"{name} {what} (exit code {process.returncode}); its output:\n{tail}")


def wait_ready(
    process: subprocess.Popen,
    url: str,
    log: IO[bytes],
    name: str = "ember serve",
    client: httpx.Client | None = None,
) -> float:
    """perf_counter time at which /health first answered 200 (`name`: the server, in
    the error when it exits or never answers). `client`: one made before the spawn (each
    call of httpx's own functions makes a client, 20-40 ms of this process's time)."""
    http = client or httpx
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise _exit_error(process, log, "exited before it was ready", name)
        try:
            if http.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S).status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise _exit_error(process, log, f"was not healthy after {STARTUP_TIMEOUT_S:.0f} s", name)


def first_chat(url: str, client: httpx.Client | None = None) -> float:
    """perf_counter time at which the answer to a first chat completion had arrived."""
    http = client or httpx
    response = http.post(f"{url}/v1/chat/completions", json=CHAT, timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    return time.perf_counter()


def read_phases(url: str) -> list[dict]:
    """The server's start-up phases from its /metrics, in order of their end (none from a
    server that does not report them)."""
    response = httpx.get(f"{url}/metrics", timeout=REQUEST_TIMEOUT_S)
    if response.status_code != 200:
        return []
    return parse_phases(response.text)


def parse_phases(metrics_text: str) -> list[dict]:
    """`ember_startup_seconds` / `ember_startup_cpu_seconds` samples as
    [{process, phase, at_s, cpu_s}], by at_s."""
    from prometheus_client.parser import text_string_to_metric_families

    phases: dict[tuple[str, str], dict] = {}
    for family in text_string_to_metric_families(metrics_text):
        field = PHASE_METRICS.get(family.name)
        for sample in family.samples if field else []:
            key = (sample.labels["process"], sample.labels["phase"])
            phases.setdefault(key, {"process": key[0], "phase": key[1]})[field] = sample.value
    return sorted(phases.values(), key=lambda p: (p.get("at_s", 0.0), p["process"] != "api"))


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM (the server stops its engine core), SIGKILL to the group on timeout."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def cold_start(path: Path, port: int, serve_args: list[str]) -> dict:
    """One start of `ember serve`: seconds from spawn to /health 200 and to the first
    chat completion, the CPU seconds it used, and its own phases."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    cpu_before = children_cpu_s()
    # the client is made first, and the phases are read after the chat: neither is the
    # server's time (they were 50-70 ms of every first chat completion before)
    with tempfile.TemporaryFile() as log, httpx.Client() as client:
        t0 = time.perf_counter()
        process = _spawn_server(path, port, serve_args, log)
        try:
            t_ready = wait_ready(process, url, log, client=client)
            t_chat = first_chat(url, client)
            phases = read_phases(url)
        finally:
            stop_server(process)
    return {
        "ready_s": t_ready - t0,
        "first_chat_s": t_chat - t0,
        "cpu_s": children_cpu_s() - cpu_before,
        "phases": phases,
    }


def children_cpu_s() -> float:
    """CPU seconds of the waited-for descendants (the server, and its core, which it waits for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def measure(path: Path, args: argparse.Namespace) -> dict:
    """Disk speed, then `args.repeats` cold starts; the JSON report."""
    from ember.loader.checkpoint import open_checkpoint

    checkpoint = open_checkpoint(path)
    files, num_bytes = checkpoint.files, checkpoint.num_bytes
    disk_bytes_per_s = disk_read_bytes_per_s(files)
    evicted = not args.warm
    runs = []
    for _ in range(args.repeats):
        if not args.warm:
            evicted = evict(files) and evicted
        runs.append(cold_start(path, args.port, args.serve_arg))
    disk_read_s = num_bytes / disk_bytes_per_s
    median_first = statistics.median(run["first_chat_s"] for run in runs)
    return {
        "model": str(path),
        "weight_bytes": num_bytes,
        "evicted": evicted,
        "disk_read_gb_s": disk_bytes_per_s / 1e9,
        "disk_read_s": disk_read_s,
        "runs": runs,
        "median_ready_s": statistics.median(run["ready_s"] for run in runs),
        "median_first_chat_s": median_first,
        "median_cpu_s": statistics.median(run["cpu_s"] for run in runs),
        "median_phases": median_phases([run["phases"] for run in runs]),
        "startup_over_disk": median_first / max(disk_read_s, 1e-12),
    }


def median_phases(runs: list[list[dict]]) -> list[dict]:
    """Per (process, phase): the median of its end and CPU over the runs, and `took_s`,
    the wall seconds since the previous phase of the same process."""
    samples: dict[tuple[str, str], list[dict]] = {}
    for phases in runs:
        for p in phases:
            samples.setdefault((p["process"], p["phase"]), []).append(p)
    merged = [
        {
            "process": process,
            "phase": phase,
            "at_s": statistics.median(p.get("at_s", 0.0) for p in found),
            "cpu_s": statistics.median(p.get("cpu_s", 0.0) for p in found),
        }
        for (process, phase), found in samples.items()
    ]
    merged.sort(key=lambda p: (p["at_s"], p["process"] != "api"))
    previous: dict[str, dict] = {}
    for p in merged:
        before = previous.get(p["process"])
        p["took_s"] = p["at_s"] - before["at_s"] if before else 0.0
        p["took_cpu_s"] = p["cpu_s"] - before["cpu_s"] if before else 0.0
        previous[p["process"]] = p
    return merged


def print_report(result: dict) -> None:
    cache = "page cache evicted" if result["evicted"] else "page cache warm"
    print(f"start of {result['model']} ({result['weight_bytes'] / 1e9:.2f} GB of weights, {cache})")
    print(
        f"disk sequential read: {result['disk_read_gb_s']:.2f} GB/s -> "
        f"{result['disk_read_s']:.2f} s for the weights"
    )
    print(f"{'run':<5}{'ready_s':<9}{'first_chat_s':<14}cpu_s")
    for i, run in enumerate(result["runs"]):
        print(f"{i:<5}{run['ready_s']:<9.2f}{run['first_chat_s']:<14.2f}{run['cpu_s']:.2f}")
    if result["median_phases"]:
        print(
            "phases (medians; at: when it ended, seconds since the server process began; "
            "took: since that process's previous phase; cpu: that process's CPU seconds)"
        )
        print(f"{'process':<9}{'phase':<17}{'at_s':>7}{'took_s':>8}{'cpu_s':>7}")
        for p in result["median_phases"]:
            print(
                f"{p['process']:<9}{p['phase']:<17}{p['at_s']:>7.2f}"
                f"{p['took_s']:>8.2f}{p['took_cpu_s']:>7.2f}"
            )
    print(
        f"median: ready {result['median_ready_s']:.2f} s, first chat completion "
        f"{result['median_first_chat_s']:.2f} s (= {result['startup_over_disk']:.1f} x the "
        f"disk time), {result['median_cpu_s']:.2f} CPU s"
    )


def run_startup(args: argparse.Namespace) -> int:
    from ember.loader.default_models import resolve_model

    if args.repeats < 1:
        raise ValueError("--repeats must be at least 1")
    result = measure(resolve_model(args.model), args)
    print_report(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0

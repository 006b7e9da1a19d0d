"""`ember bench startup`: cold start of `ember serve`, compared with the disk's read speed.

What it measures, for one model:
- the weight bytes a start has to read (the checkpoint's safetensors shards or .gguf file);
- the disk's sequential read speed on those same files (page cache evicted, read once
  with a 16 MiB buffer), hence `disk_read_s`: the least time any start could take to read
  the weights once;
- per run, from process start: `ready_s` until GET /health answers 200, and
  `first_token_s` until the first streamed token of a 1-token completion arrives;
- `startup_over_disk`: the median first_token_s over disk_read_s (1.0 would be a start
  bounded by the disk alone).

Life cycle of a run:

    evict the weight files from the page cache (skipped with --warm)
    -> t0 -> spawn `python -m ember.cli serve MODEL --port P ...` (its own session)
    -> poll /health every 50 ms until 200 -> POST /v1/completions (stream, max_tokens=1)
    -> first `data:` chunk with text -> SIGTERM; wait (SIGKILL to its group after 60 s)

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
COMPLETION = {"prompt": "Hello", "max_tokens": 1, "stream": True}


def add_startup_args(parser: argparse.ArgumentParser) -> None:
    from ember.cli import add_model_arg

    add_model_arg(parser)
    parser.add_argument(
        "--port", type=int, default=0, help="port for `ember serve` (default: a free one per run)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="cold starts to time (default 3)")
    parser.add_argument(
        "--warm", action="store_true", help="keep the weights in the page cache between runs"
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="extra argument for `ember serve` (repeatable), e.g. --serve-arg=--kv-cache-memory=64M",
    )


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


def _exit_error(process: subprocess.Popen, log: IO[bytes], what: str) -> RuntimeError:
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - STDERR_TAIL_BYTES))
    tail = log.read().decode(errors="replace")
    return RuntimeError(f"ember serve {what} (exit code {process.returncode}); its output:\n{tail}")


def _wait_ready(process: subprocess.Popen, url: str, log: IO[bytes]) -> float:
    """perf_counter time at which /health first answered 200."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise _exit_error(process, log, "exited before it was ready")
        try:
            if httpx.get(f"{url}/health", timeout=HEALTH_TIMEOUT_S).status_code == 200:
                return time.perf_counter()
        except httpx.HTTPError:
            pass
        time.sleep(HEALTH_POLL_S)
    raise _exit_error(process, log, f"was not healthy after {STARTUP_TIMEOUT_S:.0f} s")


def _first_token(url: str) -> float:
    """perf_counter time of the first streamed chunk holding text (or of the first chunk,
    if none holds any: a token may decode to an empty string)."""
    first_chunk = None
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=COMPLETION, timeout=REQUEST_TIMEOUT_S
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            first_chunk = first_chunk or now
            choices = json.loads(line.removeprefix("data: ")).get("choices", [])
            if any(choice.get("text") for choice in choices):
                return now
    if first_chunk is None:
        raise RuntimeError("the completion stream held no data chunk")
    return first_chunk


def _stop(process: subprocess.Popen) -> None:
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
    """One start of `ember serve`: seconds from spawn to /health 200 and to the first token."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        process = _spawn_server(path, port, serve_args, log)
        try:
            t_ready = _wait_ready(process, url, log)
            t_first = _first_token(url)
        finally:
            _stop(process)
    return {"ready_s": t_ready - t0, "first_token_s": t_first - t0}


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
    median_first = statistics.median(run["first_token_s"] for run in runs)
    return {
        "model": str(path),
        "weight_bytes": num_bytes,
        "evicted": evicted,
        "disk_read_gb_s": disk_bytes_per_s / 1e9,
        "disk_read_s": disk_read_s,
        "runs": runs,
        "median_ready_s": statistics.median(run["ready_s"] for run in runs),
        "median_first_token_s": median_first,
        "startup_over_disk": median_first / max(disk_read_s, 1e-12),
    }


def print_report(result: dict) -> None:
    cache = "page cache evicted" if result["evicted"] else "page cache warm"
    print(
        f"cold start of {result['model']} ({result['weight_bytes'] / 1e9:.2f} GB of weights, {cache})"
    )
    print(
        f"disk sequential read: {result['disk_read_gb_s']:.2f} GB/s -> "
        f"{result['disk_read_s']:.2f} s for the weights"
    )
    print(f"{'run':<5}{'ready_s':<9}first_token_s")
    for i, run in enumerate(result["runs"]):
        print(f"{i:<5}{run['ready_s']:<9.2f}{run['first_token_s']:.2f}")
    print(
        f"median first token: {result['median_first_token_s']:.2f} s = "
        f"{result['startup_over_disk']:.1f} x the disk time"
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

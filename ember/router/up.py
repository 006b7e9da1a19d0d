"""`ember up`: a router and its workers on one machine, from one command.

Life cycle: start K mixed workers (`ember serve` on ports --worker-port, +1, ...; with
--pin each on its own share of the CPU cores); once all answer /health, start `ember
router` on --port in front of them and wait until it counts all K healthy; print the
URL; then wait. Ctrl-C or SIGTERM
(or the router exiting) stops them all: SIGTERM to each, SIGKILL to any still running
after a grace period. A worker that dies is reported; the router routes around it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time

import httpx

logger = logging.getLogger("ember.router")

STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixed", type=int, default=1, help="mixed workers (default 1)")
    parser.add_argument("--prefill", type=int, default=0, help="prefill workers (not yet)")
    parser.add_argument("--decode", type=int, default=0, help="decode workers (not yet)")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    parser.add_argument("--worker-port", type=int, default=8100,
                        help="first worker's port; the others follow (default 8100)")  # fmt: skip
    parser.add_argument("--pin", action="store_true",
                        help="pin each worker to its own share of the CPU cores")  # fmt: skip


def worker_flags(options: dict) -> list[str]:
    """`ember serve` flags for the engine options of `ember up`."""
    flags = []
    for name, value in options.items():
        if name == "enable_prefix_caching":
            flags += [] if value else ["--no-prefix-caching"]
        elif value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def core_sets(num_workers: int) -> list[set[int]]:
    """The CPU cores split into num_workers disjoint sets (at least one core each)."""
    cores = sorted(os.sched_getaffinity(0))
    if num_workers > len(cores):
        raise ValueError(f"--pin: {num_workers} workers but only {len(cores)} cores")
    size = len(cores) // num_workers
    return [set(cores[i * size : (i + 1) * size]) for i in range(num_workers)]


def run_up(args: argparse.Namespace, engine_options: dict) -> int:
    if args.prefill or args.decode:
        raise ValueError("--prefill/--decode: disaggregated workers are not implemented yet")
    if args.mixed < 1:
        raise ValueError("--mixed must be >= 1")
    pins = core_sets(args.mixed) if args.pin else [None] * args.mixed
    cluster = Cluster()
    signal.signal(signal.SIGTERM, lambda *_: cluster.stopping.set())
    try:
        model = [args.model] if args.model else []
        urls = []
        for i, cores in enumerate(pins):
            port = args.worker_port + i
            urls.append(f"http://127.0.0.1:{port}")
            command = ["serve", *model, "--port", str(port), *worker_flags(engine_options)]
            cluster.start(f"worker {i}", command, cores)
        cluster.wait_healthy(urls)
        router_args = [a for url in urls for a in ("--mixed", url)]
        cluster.start("router", ["router", "--port", str(args.port), *router_args])
        cluster.wait_healthy([f"http://127.0.0.1:{args.port}"], num_workers=len(urls))
        print(f"ember cluster ready: http://127.0.0.1:{args.port}/v1 "
              f"(router) -> {', '.join(urls)}", flush=True)  # fmt: skip
        cluster.watch()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


class Cluster:
    def __init__(self) -> None:
        self.processes: dict[str, subprocess.Popen] = {}
        self.stopping = threading.Event()

    def start(self, name: str, command: list[str], cores: set[int] | None = None) -> None:
        def pin():
            if cores:
                os.sched_setaffinity(0, cores)

        logger.info("starting %s: ember %s", name, " ".join(command))
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", *command], preexec_fn=pin
        )

    def wait_healthy(self, urls: list[str], num_workers: int | None = None) -> None:
        """Until each URL answers /health (a router: with all num_workers in its pool)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = list(urls)
        while pending:
            self._check_alive()
            if self.stopping.is_set() or time.monotonic() > deadline:
                raise RuntimeError("the cluster did not become healthy")
            pending = [u for u in pending if not _healthy(u, num_workers)]
            time.sleep(0.3)

    def watch(self) -> None:
        reported: set[str] = set()
        while not self.stopping.wait(0.5):
            for name, process in self.processes.items():
                if process.poll() is not None and name not in reported:
                    reported.add(name)
                    logger.warning("%s exited with %s", name, process.returncode)
                    if name == "router":
                        return

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with {process.returncode} while starting")

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in self.processes.values():
            try:
                process.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def _healthy(url: str, num_workers: int | None = None) -> bool:
    try:
        response = httpx.get(f"{url}/health", timeout=1.0)
        if response.status_code != 200:
            return False
        return num_workers is None or response.json().get("workers") == num_workers
    except (httpx.HTTPError, ValueError):
        return False

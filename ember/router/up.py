"""`ember up`: a router and its workers on one machine, from one command.

Life cycle: start the workers (`ember serve` on ports --worker-port, +1, ...: K mixed,
or N prefill + M decode, all sharing a fresh cluster secret, so that they serve only the
router and trust only each other's KV; with --pin each on its own share of the CPU
cores, which its ranks split); once all answer /health, start `ember router` on --port
in front of them and wait until it counts them all healthy; print the URL; then wait.
Ctrl-C or SIGTERM (or the router exiting) stops them all: SIGTERM to each, SIGKILL to
any still running after a grace period. A worker that exits is started again with the same command (after
1 s, doubling to 30 s between tries; --worker-restarts times at most), and meanwhile the
router routes around it; a restarted worker with a disk tier serves warm from it.

Clients' API key is the router's to check (passed in its environment, never on a command
line); the server options (queue limit, body limit, shutdown timeout, protected metrics,
tool-call and reasoning parsers) go to every worker, and the body limit and protected
metrics to the router too.

`--tensor-parallel-size N` runs every worker on N ranks; `--prefill-tensor-parallel-size`
and `--decode-tensor-parallel-size` size one role's workers otherwise (the decode workers
reshard the prefill workers' KV as it arrives: ember.kv.layout).

`--kv-disk-dir DIR` gives worker i the directory DIR/worker-i: a worker's disk tier is its
own, and the same worker finds it again after a restart.

`--kv-store mooncake` first starts a Mooncake Store (its master, bound to loopback, and a
process holding the pool's memory) and points every worker's cluster tier at it.
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

from ember.cpus import usable_cpus
from ember.router.run import add_migration_args
from ember.server.args import access_of, add_access_args, add_parser_args, add_queue_args

if TYPE_CHECKING:
    import httpx  # imported where used: `ember serve` parses its flags without it

logger = logging.getLogger("ember.router")

STARTUP_TIMEOUT_S = 600.0
STOP_GRACE_S = 30.0
RESTART_BACKOFF_S = (1.0, 30.0)  # the first wait before restarting a worker, and the longest


def add_up_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mixed", type=int, default=None,
                        help="mixed workers (default 1 without --prefill/--decode, else 0)")  # fmt: skip
    parser.add_argument("--prefill", type=int, default=0, help="prefill workers")
    parser.add_argument("--decode", type=int, default=0, help="decode workers")
    parser.add_argument("--port", type=int, default=8000, help="the router's port (default 8000)")
    parser.add_argument("--worker-port", type=int, default=8100,
                        help="first worker's port; the others follow (default 8100)")  # fmt: skip
    for role in ("prefill", "decode"):
        parser.add_argument(f"--{role}-tensor-parallel-size", type=int, default=None,
                            metavar="N", help=f"ranks of each {role} worker (default: "
                            "--tensor-parallel-size); KV is resharded between sizes")  # fmt: skip
    parser.add_argument("--pin", action="store_true",
                        help="pin each worker to its own share of the CPU cores")  # fmt: skip
    parser.add_argument("--worker-restarts", type=int, default=5,
                        help="start a worker that exits again, at most this many times "
                             "(default 5; 0: leave it down)")  # fmt: skip
    add_migration_args(parser)
    add_access_args(parser)
    add_queue_args(parser)
    add_parser_args(parser)


def server_flags(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(`ember serve` flags for each worker, `ember router` flags) from `ember up`'s own."""
    shared = ["--max-request-bytes", str(args.max_request_bytes)]
    shared += ["--read-timeout", str(args.read_timeout)]
    shared += ["--max-connections", str(args.max_connections)]
    shared += ["--protect-metrics"] if args.protect_metrics else []
    router = ["--shared-prefix-cache"] if args.shared_prefix_cache else []
    router += ["--api-key-file", os.path.abspath(args.api_key_file)] if args.api_key_file else []
    worker = [*shared, "--shutdown-timeout", str(args.shutdown_timeout)]
    worker += ["--engine-restarts", str(args.engine_restarts)]
    if args.max_queued_requests is not None:
        worker += ["--max-queued-requests", str(args.max_queued_requests)]
    worker += ["--tool-call-parser", args.tool_call_parser]
    worker += ["--reasoning-parser", args.reasoning_parser]
    router += [*shared, "--max-migrations", str(args.max_migrations)]
    router += ["--stall-timeout", str(args.stall_timeout)]
    return worker, router


# options on by default, whose flags turn them off
_NEGATED_FLAGS = {
    "enable_prefix_caching": "--no-prefix-caching",
    "gguf_blocks": "--no-gguf-blocks",
    "speculative_adaptive": "--no-speculative-adaptive",
}


def worker_flags(options: dict) -> list[str]:
    """`ember serve` flags for the engine options of `ember up`."""
    flags = []
    for name, value in options.items():
        if name in _NEGATED_FLAGS:
            flags += [] if value else [_NEGATED_FLAGS[name]]
        elif name == "kv_role":
            continue  # each worker's own
        elif isinstance(value, bool):
            flags += [f"--{name.replace('_', '-')}"] if value else []
        elif isinstance(value, tuple):
            flags += [f"--{name.replace('_', '-')}", ",".join(value)]
        elif value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def core_sets(num_workers: int) -> list[set[int]]:
    """The CPU cores split into num_workers disjoint sets (at least one core each): as
    many of this process's cores as its cgroup's CPU limit allows (ember.cpus), so that
    the workers' threads together stay within it."""
    cores = sorted(os.sched_getaffinity(0))[: usable_cpus()]
    if num_workers > len(cores):
        raise ValueError(f"--pin: {num_workers} workers but only {len(cores)} cores")
    size = len(cores) // num_workers
    return [set(cores[i * size : (i + 1) * size]) for i in range(num_workers)]


def worker_roles(args: argparse.Namespace) -> list[str]:
    if min(args.prefill, args.decode, args.mixed or 0) < 0:
        raise ValueError("--mixed, --prefill and --decode must be >= 0")
    if bool(args.prefill) != bool(args.decode):
        raise ValueError("--prefill and --decode: disaggregation needs workers of both kinds")
    mixed = args.mixed if args.mixed is not None else (0 if args.prefill else 1)
    roles = ["prefill"] * args.prefill + ["decode"] * args.decode + ["mixed"] * mixed
    if not roles:
        raise ValueError("no workers: give --mixed K, or --prefill N --decode M")
    return roles


def run_up(args: argparse.Namespace, engine_options: dict) -> int:
    if engine_options.get("nnodes", 1) != 1:
        raise ValueError(
            "--nnodes: ember up starts its workers on this machine; for a model over "
            "several hosts start each node with ember serve --nnodes N --node-rank K"
        )
    roles = worker_roles(args)
    pins = core_sets(len(roles)) if args.pin else [None] * len(roles)
    access = access_of(args)  # checks the flags before anything starts
    worker_server_flags, router_flags = server_flags(args)
    if args.worker_restarts < 0:
        raise ValueError("--worker-restarts must be >= 0")
    cluster = Cluster(max_restarts=args.worker_restarts)
    signal.signal(signal.SIGTERM, lambda *_: cluster.stopping.set())
    # one secret for the whole cluster, inherited (never on a command line): the workers
    # serve only the router, and their KV endpoints admit only each other
    os.environ.setdefault("EMBER_CLUSTER_SECRET", secrets.token_hex(16))
    worker_env = {k: v for k, v in os.environ.items() if k != "EMBER_API_KEY"}
    # the router checks the clients' keys: from the key file (its path is no secret), else
    # the one key, in its environment only (never on a command line)
    one_key = access.api_keys[0] if access.api_keys and not args.api_key_file else None
    router_env = dict(worker_env, **({"EMBER_API_KEY": one_key} if one_key else {}))
    try:
        if engine_options.get("kv_store") == "mooncake":
            engine_options = start_store(cluster, engine_options, worker_env)
        model = [args.model] if args.model else []
        urls, router_args = [], []
        for i, (role, cores) in enumerate(zip(roles, pins, strict=True)):
            port = args.worker_port + i
            url = f"http://127.0.0.1:{port}"
            urls.append(url)
            router_args += [f"--{role}", url]
            options = dict(engine_options)
            ranks = getattr(args, f"{role}_tensor_parallel_size", None)
            if ranks is not None:
                options["tensor_parallel_size"] = ranks
            if options.get("kv_port"):  # each worker's KV endpoint on its own port
                options["kv_port"] += i
            if options.get("kv_disk_dir"):  # and its own disk tier
                options["kv_disk_dir"] = os.path.join(options["kv_disk_dir"], f"worker-{i}")
            command = ["serve", *model, "--port", str(port), "--role", role,
                       *worker_flags(options), *worker_server_flags]  # fmt: skip
            cluster.start(f"{role} worker {i}", command, worker_env, cores, restart=True)
        cluster.wait_healthy(urls)
        command = ["router", "--port", str(args.port), *router_args, *router_flags]
        cluster.start("router", command, router_env)
        cluster.wait_healthy([f"http://127.0.0.1:{args.port}"], num_workers=len(urls))
        print(f"ember cluster ready: http://127.0.0.1:{args.port}/v1 "
              f"(router) -> {', '.join(urls)}", flush=True)  # fmt: skip
        cluster.watch()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


DEFAULT_STORE_MEMORY = 2 << 30


def start_store(cluster: Cluster, options: dict, env: dict[str, str]) -> dict:
    """`--kv-store mooncake`: a Mooncake Store master and a process holding its memory
    (--kv-store-memory, default 2 GiB) on this machine; the workers' options point at it."""
    from ember.kv.mooncake import store_commands, wait_listening

    memory = options.get("kv_store_memory") or DEFAULT_STORE_MEMORY
    master, holder, address = store_commands(memory)
    cluster.start_program("mooncake master", master, env)
    wait_listening(int(address.rsplit(":", 1)[1]), timeout=30.0)
    cluster.start_program("mooncake store memory", holder, env)
    holder_port = int(next(a for a in holder if a.startswith("--port=")).split("=")[1])
    wait_listening(holder_port, timeout=30.0)
    return dict(options, kv_store=f"mooncake://{address}", kv_store_memory=0)


class Cluster:
    """The processes of `ember up`; those started with `restart=True` (the workers) are
    started again when they exit, at most `max_restarts` times each."""

    def __init__(self, max_restarts: int = 0) -> None:
        self.processes: dict[str, subprocess.Popen] = {}
        self.stopping = threading.Event()
        self.max_restarts = max_restarts
        self.restarts: dict[str, int] = {}  # name -> times restarted so far
        self._specs: dict[str, tuple] = {}  # name -> how to start it again

    def start(
        self,
        name: str,
        command: list[str],
        env: dict[str, str],
        cores: set[int] | None = None,
        restart: bool = False,
    ) -> None:
        def pin():
            if cores:
                os.sched_setaffinity(0, cores)

        logger.info("starting %s: ember %s", name, " ".join(command))
        self.processes[name] = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", *command], preexec_fn=pin, env=env
        )
        if restart:
            self._specs[name] = (command, env, cores)

    def start_program(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        logger.info("starting %s: %s", name, " ".join(argv))
        self.processes[name] = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)

    def wait_healthy(self, urls: list[str], num_workers: int | None = None) -> None:
        """Until each URL answers /health (a router: with all num_workers in its pool)."""
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        pending = list(urls)
        while pending:
            self._check_alive()
            if self.stopping.is_set() or time.monotonic() > deadline:
                raise RuntimeError("the cluster did not become healthy")
            waiting = []
            for url in pending:
                response = _get_health(url)
                if _engine_dead(response):  # it serves HTTP only once its engine is up
                    raise RuntimeError(f"{url}: its engine stopped while starting")
                if not _healthy(response, num_workers):
                    waiting.append(url)
            pending = waiting
            time.sleep(0.3)

    def watch(self) -> None:
        """Until the router exits or the cluster is told to stop: reports processes that
        exit, and starts the workers among them again after a backoff."""
        reported: set[str] = set()
        due: dict[str, float] = {}  # name -> when to start it again
        while not self.stopping.wait(0.5):
            for name, process in list(self.processes.items()):
                if process.poll() is None or name in reported:
                    continue
                reported.add(name)
                logger.warning("%s exited with %s", name, process.returncode)
                if name == "router":
                    return
                tries = self.restarts.get(name, 0)
                if name in self._specs and tries < self.max_restarts:
                    first, longest = RESTART_BACKOFF_S
                    wait = min(first * 2**tries, longest)
                    logger.warning("starting %s again in %.0f s (restart %d of %d)",
                                   name, wait, tries + 1, self.max_restarts)  # fmt: skip
                    due[name] = time.monotonic() + wait
            for name, when in list(due.items()):
                if time.monotonic() >= when:
                    del due[name]
                    reported.discard(name)
                    self.restarts[name] = self.restarts.get(name, 0) + 1
                    command, env, cores = self._specs[name]
                    self.start(name, command, env, cores, restart=True)

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


def _get_health(url: str) -> httpx.Response | None:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=1.0)
    except httpx.HTTPError:
        return None


def _engine_dead(response: httpx.Response | None) -> bool:
    return response is not None and response.status_code == 503 and "engine" in response.text


def _healthy(response: httpx.Response | None, num_workers: int | None = None) -> bool:
    if response is None or response.status_code != 200:
        return False
    try:
        return num_workers is None or response.json().get("workers") == num_workers
    except ValueError:
        return False

"""Starting and stopping real `ember serve` processes for tests."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from ember.bench.startup import free_port


def child_pids(pid: int) -> list[int]:
    """Live processes whose parent is `pid` (read from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            children.append(int(entry.name))
    return children


def free_port_run(count: int = 8) -> int:
    """The first of `count` consecutive ports that are all free now (`ember up` puts
    worker i on --worker-port + i). Drawn below the kernel's ephemeral range: a port
    from it, free when looked at, was once taken by another process's connection or
    bind(0) in the seconds before a worker bound it (Errno 98 on a CI machine)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    draw = random.Random()
    for _ in range(100):
        first = draw.randrange(10_000, max(10_001, ephemeral - count))
        if _bindable(("127.0.0.1", port) for port in range(first, first + count)):
            return first
    raise AssertionError(f"no {count} consecutive free ports")


def _bindable(addresses) -> bool:
    """Whether every (host, port) of `addresses` can be bound now."""
    try:
        for address in addresses:
            with socket.socket() as sock:
                sock.bind(address)
    except OSError:
        return False
    return True


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def pid_serving(url: str) -> int:
    """The pid of the `ember serve` process listening at `url` (read from /proc)."""
    port = url.rsplit(":", 1)[1]
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if (
            b"serve" in argv
            and b"--port" in argv
            and argv[argv.index(b"--port") + 1] == port.encode()
        ):
            return int(entry.name)
    raise AssertionError(f"no process serves {url}")


WORKER_ARGS = ["--kv-cache-memory", "16M", "--max-model-len", "512", "--block-size", "8"]


class Up:
    """`ember up MODEL ARGS...`; `stop()` sends SIGTERM and expects a clean exit."""

    def __init__(
        self,
        model: str,
        *args: str,
        env: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.headers = headers or {}  # what the router's /load needs (its API key)
        self.port, worker_port = free_port(), free_port_run()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "up", model, "--port", str(self.port),
             "--worker-port", str(worker_port), *WORKER_ARGS, *args],
            stdout=subprocess.PIPE, text=True,
            env=dict(os.environ, EMBER_LOG_LEVEL="WARNING", **(env or {})),
        )  # fmt: skip
        line = self.process.stdout.readline()
        if f"{self.url}/v1" not in line:  # stop whatever it did start, workers included
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(60)
            raise AssertionError(f"ember up did not come up: {line!r}")
        try:
            self.workers = {w["url"]: w["pool"] for w in self.load()["workers"]}
        except BaseException:
            self.stop()
            raise

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", headers=self.headers, timeout=5).json()

    def urls(self, pool: str) -> list[str]:
        return [url for url, kind in self.workers.items() if kind == pool]

    def worker_load(self, url: str) -> dict:
        return httpx.get(f"{url}/load", timeout=5).json()

    def wait_no_blocks(self, timeout: float = 20.0) -> None:
        """Until every live worker has no KV block in use (held transfers released)."""
        deadline = time.monotonic() + timeout
        while True:
            loads = [self.worker_load(url) for url in self.workers]
            if all(x["kv_blocks_used"] == 0 for x in loads) or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [x["kv_blocks_used"] for x in loads] == [0] * len(loads), "blocks leaked"
        assert all(x["kv_transfer"]["held"] == 0 for x in loads)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(60) == 0
        assert not child_pids(self.process.pid)


# an idle engine core takes all of its KV pool's pages (the default: up to 4 GiB), so
# servers that do not size their pool get a small one: many run at once in the suite
TEST_KV_CACHE_MEMORY = ["--kv-cache-memory", "256M"]


class EmberServer:
    """`ember serve MODEL ARGS...` on a free port; `stop()` sends SIGTERM. Without a
    `--kv-cache-memory` in `args`, the pool is TEST_KV_CACHE_MEMORY."""

    def __init__(
        self,
        model: str,
        *args: str,
        startup_timeout: float = 180.0,
        host: str = "127.0.0.1",
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        if not any(arg.startswith("--kv-cache-memory") for arg in args):
            args = (*args, *TEST_KV_CACHE_MEMORY)
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        env = dict(os.environ, EMBER_LOG_LEVEL="WARNING", **(env or {}))
        env.pop("EMBER_API_KEY", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "ember.cli", "serve", model, "--host", host,
             "--port", str(self.port), *args],
            env=env,
        )  # fmt: skip
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ember serve exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            self.stop()
            raise RuntimeError("ember serve did not become healthy")
        (self.core_pid,) = child_pids(self.process.pid)

    def load(self) -> dict:
        return httpx.get(f"{self.url}/load", timeout=5).json()

    def wait_idle(self, timeout: float = 30.0) -> dict:
        """The /load report once nothing runs or waits (or the last one at timeout)."""
        deadline = time.monotonic() + timeout
        load = self.load()
        while time.monotonic() < deadline:
            if load["num_running"] == 0 and load["num_waiting"] == 0:
                break
            time.sleep(0.05)
            load = self.load()
        return load

    def stop(self, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def moe_samples(url: str, counted: str, timeout: float = 10.0) -> list:
    """The `ember_moe_*` samples of a server's /metrics once a `counted` sample is above
    zero (the engine reports expert counts when it goes idle), or the last read at timeout."""
    from prometheus_client.parser import text_string_to_metric_families

    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{url}/metrics").text
        samples = [
            s
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name.startswith("ember_moe_")
        ]
        if any(s.value for s in samples if s.name == counted) or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def tiny_server(tiny_checkpoint, *args: str):
    """The body of a module fixture: `ember serve` of the tiny llama checkpoint, served as
    "tiny" with `args`, stopped (and checked to exit cleanly) after the module."""
    server = EmberServer(str(tiny_checkpoint("llama")), *args, "--served-model-name", "tiny")
    yield server
    assert server.stop() == 0


def with_hosts_file(hosts: Path, argv: list[str]) -> list[str]:
    """`argv` run in a mount namespace of its own whose /etc/hosts is `hosts` (a name
    resolver for names only this process knows: several "hosts" on one machine); skips
    the calling test where namespaces cannot be made."""
    import shlex
    import shutil

    import pytest

    if shutil.which("unshare") is None:
        pytest.skip("no unshare command")
    mount = f"mount --bind {shlex.quote(str(hosts))} /etc/hosts"
    for flags in ("-m", "-rm"):
        probe = subprocess.run(["unshare", flags, "sh", "-c", mount], capture_output=True)
        if probe.returncode == 0:
            return ["unshare", flags, "sh", "-c", f"{mount} && exec {shlex.join(argv)}"]
    pytest.skip(f"cannot make a mount namespace: {probe.stderr.decode().strip()}")


def free_port_on(*hosts: str) -> int:
    """A port free on every one of `hosts` (loopback addresses) now."""
    for _ in range(100):
        port = free_port()
        if _bindable((host, port) for host in hosts):
            return port
    raise AssertionError(f"no port free on all of {hosts}")

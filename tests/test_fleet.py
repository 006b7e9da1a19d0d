"""A router whose workers come and go while it serves, with real `ember serve` processes:
they join in all three ways (static flag, registration, DNS discovery) and leave (a
worker stopping drains itself, a name losing an address drains that worker) under an
agentic load that must see no failed request. And a disaggregated cluster spread over
several loopback addresses, found by name, its KV over TCP: nothing assumes one host.

Names resolve through a private /etc/hosts (the router runs in a mount namespace of its
own), changed in place while the router runs, as a headless Service's DNS changes."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import httpx

from tests.server_utils import (
    WORKER_ARGS,
    EmberServer,
    free_port,
    free_port_on,
    with_hosts_file,
)

SECRET = "fleet-test-secret"
ENV = {"EMBER_CLUSTER_SECRET": SECRET}


class Router:
    """`ember router ARGS...` with `hosts` as its /etc/hosts."""

    def __init__(self, hosts, *args: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "ember.cli", "router", "--port", str(self.port),
                "--health-interval", "0.2", "--discover-interval", "0.3", *args]  # fmt: skip
        env = dict(os.environ, EMBER_LOG_LEVEL="WARNING", **ENV)
        self.process = subprocess.Popen(with_hosts_file(hosts, argv), env=env)
        self.wait_for(lambda: self.workers() is not None, "the router to start")

    def workers(self) -> dict[str, dict] | None:
        try:
            return {
                w["url"]: w for w in httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
            }
        except httpx.HTTPError:
            return None

    def wait_for(self, condition, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            assert self.process.poll() is None, "the router exited"
            assert time.monotonic() < deadline, f"timed out waiting for {what}: {self.workers()}"
            time.sleep(0.1)

    def status(self, url: str) -> str | None:
        entry = (self.workers() or {}).get(url)
        return entry["status"] if entry else None

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        self.process.wait(30)


class AgentLoad:
    """Agent sessions against the router, one request at a time each: a session resends
    its growing conversation every turn for three turns, then a new session starts."""

    def __init__(self, url: str, sessions: int = 4) -> None:
        self.url = url
        self.results: list[tuple[int, str | None, str]] = []  # (status, worker, error text)
        self._stop = threading.Event()
        self._ids = itertools.count()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(sessions)]
        for thread in self._threads:
            thread.start()

    def _run(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                session = f"agent-{next(self._ids)}"
                messages = [{"role": "system", "content": "You are a coding agent. " * 8}]
                for turn in range(3):
                    messages.append({"role": "user", "content": f"step {turn} of {session}"})
                    body = {"messages": messages, "max_tokens": 4, "stream": turn == 1}
                    try:
                        response = client.post(f"{self.url}/v1/chat/completions", json=body,
                                               headers={"x-session-affinity": session})  # fmt: skip
                        failed = response.status_code != 200 or '"error"' in response.text
                        error = response.text[:300] if failed else ""
                        status = (
                            500 if failed and response.status_code == 200 else response.status_code
                        )
                        self.results.append((status, response.headers.get("x-ember-worker"), error))
                    except httpx.HTTPError as exc:
                        self.results.append((0, None, repr(exc)))
                    messages.append({"role": "assistant", "content": "ok"})

    def served_by(self) -> Counter:
        return Counter(worker for status, worker, _ in self.results if status == 200)

    def stop(self) -> list[tuple[int, str | None, str]]:
        self._stop.set()
        for thread in self._threads:
            thread.join(120)
        return [r for r in self.results if r[0] != 200]


def test_workers_join_three_ways_and_leave_under_an_agentic_load(tiny_checkpoint, tmp_path):
    model = str(tiny_checkpoint("llama"))
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n")  # the workers' name resolves to nothing yet
    name_port = free_port_on("127.0.0.1", "127.0.0.2")
    servers = [EmberServer(model, *WORKER_ARGS, env=ENV)]  # joins by a static flag
    router = load = None
    try:
        router = Router(hosts, "--mixed", servers[0].url,
                        "--discover", f"dns://workers.ember.test:{name_port}")  # fmt: skip
        router.wait_for(lambda: router.status(servers[0].url) == "up", "the static worker")
        load = AgentLoad(router.url)

        # joins by registering itself
        servers.append(EmberServer(model, *WORKER_ARGS, "--register", router.url, env=ENV))
        registered = servers[1].url
        router.wait_for(lambda: router.status(registered) == "up", "the registered worker")
        # joins by DNS: its address appears under the name the router resolves
        servers.append(EmberServer(model, *WORKER_ARGS, host="127.0.0.2", port=name_port,
                                   env=ENV))  # fmt: skip
        discovered = servers[2].url
        with open(hosts, "a") as f:  # in place: the bind mount sees the same file
            f.write("127.0.0.2 workers.ember.test\n")
        router.wait_for(lambda: router.status(discovered) == "up", "the discovered worker")
        entries = router.workers()
        assert entries[registered]["source"] == "register"
        assert entries[discovered]["source"] == f"dns://workers.ember.test:{name_port}"
        assert entries[discovered]["model"] == model and entries[discovered]["pool"] == "mixed"
        # new workers take load (new sessions land on them)
        router.wait_for(lambda: all(load.served_by()[s.url] >= 3 for s in servers),
                        "every worker to serve the load")  # fmt: skip

        # leaves by stopping: it tells the router, which drains it; what it had finishes
        assert servers[1].stop() == 0
        router.wait_for(lambda: router.status(registered) is None, "the stopped worker to go")
        before = load.served_by()[registered]  # forgotten once it had nothing in flight
        # leaves DNS: drained, forgotten once idle, then stopped
        hosts.write_text("127.0.0.1 localhost\n")
        router.wait_for(lambda: router.status(discovered) is None, "the undiscovered worker to go")
        served = load.served_by()[discovered]
        time.sleep(2.0)
        assert load.served_by()[discovered] == served  # nothing new reaches it
        assert load.served_by()[registered] == before
        assert servers[2].stop() == 0
        count = len(load.results)
        router.wait_for(lambda: len(load.results) >= count + 6, "the load to go on")
        failures = load.stop()
        load = None
        assert failures == [], failures[:5]
        assert list(router.workers()) == [servers[0].url]
    finally:
        if load is not None:
            load.stop()
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()


def test_a_disaggregated_cluster_on_several_addresses_found_by_name(tiny_checkpoint, tmp_path):
    """A prefill worker at 127.0.0.2 and a decode worker at 127.0.0.3, both on the same
    port (as pods are), discovered by their names; the decode worker fetches the KV over
    TCP from the address the prefill worker advertises."""
    model = str(tiny_checkpoint("llama"))
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.2 prefill.ember.test\n127.0.0.3 decode.ember.test\n")
    port = free_port_on("127.0.0.2", "127.0.0.3")
    servers, router = [], None
    try:
        servers.append(EmberServer(model, *WORKER_ARGS, "--role", "prefill", "--kv-host",
                                   "127.0.0.2", host="127.0.0.2", port=port, env=ENV))  # fmt: skip
        servers.append(EmberServer(model, *WORKER_ARGS, "--role", "decode", "--kv-transport",
                                   "tcp", host="127.0.0.3", port=port, env=ENV))  # fmt: skip
        router = Router(hosts, "--discover", f"dns://prefill.ember.test:{port}",
                        "--discover", f"dns://decode.ember.test:{port}")  # fmt: skip
        prefill, decode = (f"http://127.0.0.{i}:{port}" for i in (2, 3))
        router.wait_for(lambda: router.status(prefill) == router.status(decode) == "up",
                        "both workers")  # fmt: skip
        pools = {url: entry["pool"] for url, entry in router.workers().items()}
        assert pools == {prefill: "prefill", decode: "decode"}  # from their /load
        body = {"messages": [{"role": "user", "content": "Say hello. " * 20}], "max_tokens": 6}
        response = httpx.post(f"{router.url}/v1/chat/completions", json=body, timeout=60)
        assert response.status_code == 200, response.text
        assert response.headers["x-ember-prefill-worker"] == prefill
        assert response.headers["x-ember-worker"] == decode
        usage = response.json()["usage"]
        assert usage["completion_tokens"] >= 1 and usage["prompt_tokens"] > 40
        router.wait_for(
            lambda: router.workers()[decode]["reported"]["kv_transfer"]["bytes_received"] > 0,
            "the decode worker's report of the KV it received",
        )
    finally:
        if router is not None:
            router.stop()
        for server in servers:
            server.stop()

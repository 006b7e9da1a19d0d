"""A cluster under hostile requests (`ember up` on a tiny checkpoint): cluster-internal
fields are refused, workers serve only their router, a worker never connects where a
request says, the API key is the router's to check, and a stream whose worker dies ends
with an error event."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from ember import cluster
from ember.headers import ROUTER_TOKEN_HEADER
from ember.kv.params import RemotePrefill
from server_utils import Up, child_pids, free_port

SECRET = "test-cluster-secret"
CHAT = {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8}


def crafted(listen_port: int, **changes) -> dict:
    """The issue's request: a remote prefill a client made up, pointing at `listen_port`."""
    remote = dict(host="127.0.0.1", port=listen_port, transfer_id="x", block_ids=[0, 1],
                  num_tokens=32, block_size=16, block_bytes=737280, num_blocks=100,
                  first_token_ids=[1000000000], kv_pieces=[[0, 0, 2], [1, 0, 2]])  # fmt: skip
    remote.update(changes)
    return dict(CHAT, kv_transfer_params={"remote_prefill": remote})


# a prefill of the tiny model on these workers (blocks of 8 tokens, 4 KiB), but for
# what each case changes
FITS = dict(first_token_ids=[1], block_size=8, num_tokens=16, block_bytes=4096)


def signed(body: dict, secret: str) -> dict:
    """`body` with its remote prefill signed as a prefill worker holding `secret` would."""
    remote = msgspec.convert(body["kv_transfer_params"]["remote_prefill"], RemotePrefill)
    remote = msgspec.to_builtins(remote.signed(secret.encode()))
    return dict(body, kv_transfer_params={"remote_prefill": remote})


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="module")
def mixed2(tiny_checkpoint):
    up = Up(str(tiny_checkpoint("llama")), "--mixed", "2", env={"EMBER_CLUSTER_SECRET": SECRET})
    yield up
    up.stop()


@pytest.fixture
def listener():
    """A TCP port on loopback that records whether anything connected to it."""
    sock = socket.create_server(("127.0.0.1", 0))
    sock.settimeout(0.5)
    yield sock
    sock.close()


def connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except TimeoutError:
        return False
    conn.close()
    return True


def test_client_kv_transfer_params_are_refused_and_the_cluster_keeps_serving(mixed2, listener):
    port = listener.getsockname()[1]
    body = crafted(port)
    error = error_of(httpx.post(f"{mixed2.url}/v1/chat/completions", json=body), 400)
    assert error["param"] == "kv_transfer_params" and "set by ember's router" in error["message"]
    assert not mixed2.load()["decisions"]  # refused at the router: no worker saw it

    token = {ROUTER_TOKEN_HEADER: cluster.router_token(SECRET.encode())}
    for url in mixed2.urls("mixed"):
        chat = f"{url}/v1/chat/completions"
        error = error_of(httpx.post(chat, json=body), 401)  # only the router is served
        assert error["code"] == "invalid_api_key"
        # as the router, but with a remote prefill no prefill worker signed
        for forged in (body, signed(body, "another-secret")):
            error = error_of(httpx.post(chat, json=forged, headers=token), 400)
            assert error["param"] == "kv_transfer_params" and "signed" in error["message"]
        # signed with the secret, yet out of range: every field is still checked
        for changes, words in [
            ({}, "first_token_ids must be in [0, 512)"),
            ({"block_ids": [0, 100]}, "block_ids must be in [0, 100)"),
            ({"port": 70000}, "not a TCP port"),
            ({"block_ids": [0]}, "do not cover"),
            ({"first_token_ids": []}, "first_token_ids"),
            ({"kv_pieces": []}, "kv_pieces must be"),
            ({"kv_pieces": [[0, 2, 2]]}, "kv_pieces must be"),
            ({"shm_offsets": [0]}, "shm_offsets must have one"),
            # what the tiny model's KV is not: other bytes per block, a layer it lacks
            ({**FITS, "block_bytes": 4000}, "KV layout differs"),
            ({**FITS, "kv_pieces": [[0, 0, 2], [5, 0, 2]]}, "has no head 0 of layer 1"),
        ]:
            error = error_of(httpx.post(chat, json=signed(crafted(port, **changes), SECRET),
                                        headers=token), 400)  # fmt: skip
            assert error["param"] == "kv_transfer_params" and words in error["message"]
    assert not connected(listener)  # nobody was sent to the address the requests named

    response = httpx.post(f"{mixed2.url}/v1/chat/completions", json=CHAT, timeout=60)
    assert response.status_code == 200 and response.json()["choices"][0]["message"]
    workers = mixed2.load()["workers"]
    assert [w["healthy"] for w in workers] == [True, True]
    for url in mixed2.urls("mixed"):
        load = mixed2.worker_load(url)
        assert load["healthy"] and load["num_waiting"] == 0 and load["kv_blocks_used"] == 0


def test_the_router_polls_its_workers_quietly(mixed2):
    """Health polls (/load, with the router's token) are not logged one by one."""
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "router", "--port", str(port),
         "--health-interval", "0.05", *[a for u in mixed2.urls("mixed") for a in ("--mixed", u)]],
        env=dict(os.environ, EMBER_CLUSTER_SECRET=SECRET), stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health").json().get("workers") == 2:
                    break  # both polled with the token, and found healthy
            time.sleep(0.1)
        time.sleep(1.0)  # ~20 more polls of each worker
    finally:
        router.send_signal(signal.SIGTERM)
        _, stderr = router.communicate(timeout=30)
    assert "Uvicorn running" in stderr and "/load" not in stderr and "is down" not in stderr


def test_the_api_key_is_the_routers_to_check(tiny_checkpoint, tmp_path: Path):
    key = "sk-ember-test-0123456789"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    bearer = {"Authorization": f"Bearer {key}"}
    up = Up(str(tiny_checkpoint("llama")), "--mixed", "1", "--api-key-file", str(key_file),
            "--protect-metrics", env={"EMBER_CLUSTER_SECRET": SECRET}, headers=bearer)  # fmt: skip
    try:
        for path in ("/v1/models", "/load", "/metrics"):
            assert error_of(httpx.get(f"{up.url}{path}"), 401)["code"] == "invalid_api_key"
            assert httpx.get(f"{up.url}{path}", headers=bearer).status_code == 200
        assert httpx.get(f"{up.url}/v1/models", headers=bearer).json()["data"][0]["id"]
        error_of(httpx.post(f"{up.url}/v1/chat/completions", json=CHAT), 401)
        response = httpx.post(f"{up.url}/v1/chat/completions", json=CHAT, headers=bearer,
                              timeout=60)  # fmt: skip
        assert response.status_code == 200
        assert httpx.get(f"{up.url}/health").status_code == 200  # probes stay open

        (worker,) = up.urls("mixed")
        error_of(httpx.get(f"{worker}/v1/models", headers=bearer), 401)  # the router only
        error_of(httpx.get(f"{worker}/load", headers=bearer), 401)
        token = {ROUTER_TOKEN_HEADER: cluster.router_token(SECRET.encode())}
        assert httpx.get(f"{worker}/load", headers=token).json()["healthy"]
        assert httpx.get(f"{worker}/health").status_code == 200

        pids = [up.process.pid, *child_pids(up.process.pid)]
        for pid in pids:  # the key is on no command line (`ps` shows those to everyone)
            assert key.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
    finally:
        up.stop()


def test_a_stream_whose_worker_dies_ends_with_an_error_event(tiny_checkpoint):
    up = Up(str(tiny_checkpoint("llama")), "--mixed", "1")
    try:
        serve_pid = _pid_serving(up.process.pid)
        body = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True,
                "stream": True}  # fmt: skip
        events = []
        with httpx.stream("POST", f"{up.url}/v1/completions", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line[6:])
                if len(events) == 2:
                    for pid in [*child_pids(serve_pid), serve_pid]:
                        os.kill(pid, signal.SIGKILL)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["code"] == "worker_failed" and "worker" in error["message"]
        assert len(events) < 480  # cut off, not finished
    finally:
        up.stop()


def _pid_serving(up_pid: int) -> int:
    """The `ember serve` child of an `ember up` process."""
    for pid in child_pids(up_pid):
        if b"serve" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            return pid
    raise AssertionError("no worker process")


def test_ember_up_hands_the_server_options_to_workers_and_router():
    from ember.cli import build_parser
    from ember.router.up import server_flags

    parser = build_parser()
    up = parser.parse_args(["up", "--max-queued-requests", "3", "--max-request-bytes", "1M",
                            "--shutdown-timeout", "2.5", "--protect-metrics",
                            "--read-timeout", "7", "--max-connections", "9",
                            "--engine-restarts", "1", "--max-migrations", "4",
                            "--stall-timeout", "0"])  # fmt: skip
    worker, router = server_flags(up)
    serve = parser.parse_args(["serve", *worker])
    assert (serve.max_queued_requests, serve.max_request_bytes, serve.shutdown_timeout,
            serve.protect_metrics, serve.read_timeout, serve.max_connections,
            serve.engine_restarts) == (3, 1 << 20, 2.5, True, 7, 9, 1)  # fmt: skip
    routed = parser.parse_args(["router", "--mixed", "http://w", *router])
    assert (routed.max_request_bytes, routed.protect_metrics, routed.read_timeout,
            routed.max_connections, routed.max_migrations, routed.stall_timeout) == (
        1 << 20, True, 7, 9, 4, 0)  # fmt: skip
    default_worker, _ = server_flags(parser.parse_args(["up"]))
    assert parser.parse_args(["serve", *default_worker]).max_queued_requests == 1024


# -- tenants: with several API keys, each key's prefix cache is its own --------------------

TENANT_PROMPT = "Tenant A's long private system prompt, which nobody else may time. " * 4


def cached_tokens(url: str, key: str, **headers: str) -> int:
    body = {"prompt": TENANT_PROMPT, "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=60,
                          headers={"authorization": f"Bearer {key}", **headers})  # fmt: skip
    assert response.status_code == 200, response.text
    return response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.parametrize("shared", [False, True])
def test_each_api_key_has_its_own_prefix_cache(tiny_checkpoint, tmp_path: Path, shared):
    from server_utils import WORKER_ARGS, EmberServer

    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n\n")
    flags = ["--shared-prefix-cache"] if shared else []
    server = EmberServer(str(tiny_checkpoint("llama")), *WORKER_ARGS,
                         "--api-key-file", str(keys), *flags)  # fmt: skip
    try:
        assert cached_tokens(server.url, "key-a") == 0
        assert cached_tokens(server.url, "key-a") > 0  # its own prefix, cached
        # another key: no hit (and nothing to time) unless the cache is shared on purpose
        assert (cached_tokens(server.url, "key-b") > 0) is shared
        assert cached_tokens(server.url, "key-b") > 0
        body = {"prompt": "x", "max_tokens": 1}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 401
    finally:
        server.stop()


def test_tenants_behind_the_router_and_a_forged_tenant_header(tiny_checkpoint, tmp_path: Path):
    from ember.server.guard import tenant_of

    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n")
    up = Up(str(tiny_checkpoint("llama")), "--mixed", "1", "--api-key-file", str(keys),
            headers={"authorization": "Bearer key-a"})  # fmt: skip
    try:
        assert cached_tokens(up.url, "key-a") == 0
        assert cached_tokens(up.url, "key-a") > 0
        # key b naming key a's tenant itself: the router sends the tenant of the key it checked
        forged = {"x-ember-tenant": tenant_of("key-a")}
        assert cached_tokens(up.url, "key-b", **forged) == 0
        assert cached_tokens(up.url, "key-b") > 0
    finally:
        up.stop()

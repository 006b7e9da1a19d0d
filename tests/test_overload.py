"""Overload and slow clients: what a flood or a trickle of requests costs an ember
service is bounded, and every refusal is an OpenAI error with its status.

- a request head that does not come within --read-timeout is a 408 and the connection is
  closed; so is a body that does not (the guard's deadline);
- connections over --max-connections get a 503 at once, which a client that has sent a
  whole request reads before an orderly close (never a reset);
- requests with more messages or tools than the limits are 400s naming the field;
- behind a router, a worker whose queue is full (429) is skipped, and with every worker
  full the client gets the 429 and its Retry-After.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from ember.bench.startup import free_port
from server_utils import WORKER_ARGS, EmberServer


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    server = EmberServer(str(tiny_checkpoint("llama")), *WORKER_ARGS, "--read-timeout", "1",
                         "--max-connections", "6")  # fmt: skip
    yield server
    assert server.stop() == 0


def raw(url: str, data: bytes, wait: float = 5.0, resets: bool = True) -> bytes:
    """What the server answers on one connection that sends `data` (and then nothing)
    before it closes the connection, read for at most `wait` seconds; unless `resets`, a
    connection reset fails the test."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(data)
        answer = b""
        try:
            while chunk := sock.recv(65536):
                answer += chunk
        except ConnectionResetError:  # closed with what we sent unread: the answer came first
            if not resets:
                raise
    return answer


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)["error"]


def test_a_head_or_a_body_that_trickles_gets_a_408(server):
    start = time.monotonic()
    status, error = status_and_error(raw(server.url, b"POST /v1/completions HTTP/1.1\r\nHo"))
    assert status == 408 and error["code"] == "request_timeout"
    status, _ = status_and_error(raw(server.url, b""))  # connected, sent nothing
    assert status == 408
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"content-length: 100\r\n\r\n{\"prompt\": ")  # fmt: skip
    status, error = status_and_error(raw(server.url, head))
    assert status == 408 and "body" in error["message"]
    assert time.monotonic() - start < 15  # each closed after about --read-timeout 1
    body = {"prompt": "fine", "max_tokens": 2}
    assert httpx.post(f"{server.url}/v1/completions", json=body, timeout=30).status_code == 200
    assert server.wait_idle()["kv_blocks_used"] == 0


def test_connections_over_the_limit_get_a_503_at_once(server):
    held = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(6)]
    try:
        time.sleep(0.2)
        status, error = status_and_error(raw(server.url, b"GET /health HTTP/1.1\r\n\r\n"))
        assert status == 503 and error["code"] == "too_many_connections"
        # clients that send a whole request at once (as an HTTP client does) read the 503,
        # then an orderly close: their unread request does not reset the connection
        body = json.dumps({"prompt": "x" * 60_000, "max_tokens": 1}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                   b"application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(lambda _: raw(server.url, request, resets=False), range(40)))
        assert {status_and_error(a)[0] for a in answers} == {503}
        # a client slow to send its request (a busy event loop) is answered once it has
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
            time.sleep(2.5)
            sock.sendall(request)
            answer = b""
            while chunk := sock.recv(65536):  # a reset here fails the test
                answer += chunk
        assert status_and_error(answer)[0] == 503
    finally:
        for sock in held:
            sock.close()
    deadline = time.monotonic() + 5
    while httpx.get(f"{server.url}/health").status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)


def test_too_many_messages_or_tools_are_400s_naming_them(server):
    message = {"role": "user", "content": "x"}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    for field, body in (
        ("messages", {"messages": [message] * 10_001}),
        ("tools", {"messages": [message], "tools": [tool] * 513}),
    ):
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
        assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_a_full_worker_is_skipped_and_all_full_is_a_429(tiny_checkpoint):
    """Two workers queueing one request each, their engines frozen: a second request of
    the first's session does not wait on its full home but on the other worker; a third
    is refused with the workers' Retry-After; once they thaw, both queued ones are served."""
    args = [*WORKER_ARGS, "--max-queued-requests", "1"]
    workers = [EmberServer(str(tiny_checkpoint("llama")), *args) for _ in range(2)]
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "router", "--port", str(port),
         "--health-interval", "0.2", *[a for w in workers for a in ("--mixed", w.url)]],
        env=dict(os.environ, EMBER_LOG_LEVEL="WARNING"),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).json().get("workers") == 2:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        body = {"prompt": "x " * 20, "max_tokens": 8}
        for worker in workers:  # sent requests wait: each worker's queue holds one
            os.kill(worker.core_pid, signal.SIGSTOP)
        try:
            with ThreadPoolExecutor(2) as pool:
                queued = []
                for i in (1, 2):
                    queued.append(
                        pool.submit(
                            httpx.post,
                            f"{url}/v1/completions",
                            json=body,
                            headers={"x-session-affinity": "s"},
                            timeout=60,
                        )
                    )
                    deadline = time.monotonic() + 30
                    while sum(w.load()["num_waiting"] for w in workers) < i:
                        assert time.monotonic() < deadline, [w.load() for w in workers]
                        time.sleep(0.01)
                assert [w.load()["num_waiting"] for w in workers] == [1, 1]
                refused = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
                for worker in workers:
                    os.kill(worker.core_pid, signal.SIGCONT)
                assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
                assert refused.json()["error"]["type"] == "rate_limit_error"
                assert [f.result().status_code for f in queued] == [200, 200]
        finally:
            for worker in workers:
                os.kill(worker.core_pid, signal.SIGCONT)
    finally:
        router.send_signal(signal.SIGTERM)
        router.wait(30)
        for worker in workers:
            worker.stop()


def test_a_client_that_leaves_while_sending_its_body_reaches_no_handler():
    """Found by `make chaos` (disconnect storms): the router's handler read a body whose
    client had gone and failed with ClientDisconnect; the guard now ends such a request
    itself, answering no one."""
    import asyncio

    from ember.server.guard import Access, Guard

    called, sent = [], []

    async def app(scope, receive, send):
        called.append(scope["path"])

    messages = [{"type": "http.request", "body": b'{"pro', "more_body": True},
                {"type": "http.disconnect"}]  # fmt: skip

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/completions", "headers": [(b"content-length", b"99")]}
    asyncio.run(Guard(app, Access())(scope, receive, send))
    assert called == [] and sent == []


def test_an_idle_connection_outlives_the_clients_own_expiry():
    """The server keeps an idle kept-alive connection longer than httpx (the OpenAI and
    Anthropic SDKs, ember's router) keeps it: the client lets it go first, and never sends
    a request on a connection the server is closing (a reset, seen under overload as
    httpx.ReadError before this was so)."""
    from ember.server.http_protocol import uvicorn_options

    options = uvicorn_options(read_timeout=30, max_connections=10)
    assert options["timeout_keep_alive"] > 2 * httpx.Limits().keepalive_expiry

"""Prefill/decode disaggregation end to end: `ember up --prefill N --decode M` on a tiny
checkpoint, against one mixed worker serving the same requests as the reference."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_utils import WORKER_ARGS, EmberServer, Up, child_pids, pid_serving

LONG = "The quick brown fox jumps over the lazy dog while the cat watches. " * 6


def post(url: str, path: str, body: dict, session: str | None = None) -> httpx.Response:
    headers = {"x-session-affinity": session} if session else {}
    return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=120)


def stream(url: str, path: str, body: dict) -> tuple[str, dict, list[str]]:
    """(text, usage, finish reasons) of a streamed response."""
    import json

    body = dict(body, stream=True, stream_options={"include_usage": True})
    text, usage, reasons = "", None, []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "kv_transfer_params" not in chunk  # internal to the cluster
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                if choice.get("finish_reason"):
                    reasons.append(choice["finish_reason"])
    return text, usage, reasons


def requests_made_of(prompt: str) -> list[tuple[str, dict]]:
    chat = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}  # fmt: skip
    completion = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
    return [("/v1/chat/completions", chat), ("/v1/completions", completion)]


def answer(response: dict) -> list:
    choice = response["choices"][0]
    text = choice.get("text") or choice.get("message", {}).get("content")
    chosen = [e["token"] for e in (choice.get("logprobs") or {}).get("content") or []]
    return [text, chosen, choice["finish_reason"]]


def logprobs(response: dict) -> list[float]:
    entries = (response["choices"][0].get("logprobs") or {}).get("content") or []
    return [e["logprob"] for e in entries]


def assert_answers_alike(cluster, reference, made: list[tuple[str, dict]]) -> None:
    """The cluster answers as the reference worker does: usage, tokens and finish reasons
    equal, logprobs up to rounding."""
    for path, body in made:
        want = post(reference.url, path, body).json()
        got = post(cluster.url, path, body).json()
        assert got["usage"] == want["usage"]
        assert answer(got) == answer(want)
        assert logprobs(got) == pytest.approx(logprobs(want), abs=1e-4)


# -- clusters of their own -------------------------------------------------------------


def test_sessions_stay_on_their_home_prefill_worker_and_others_spread(tiny_checkpoint):
    cluster = Up(str(tiny_checkpoint("llama")), "--prefill", "2", "--decode", "1")
    try:
        homes = {}
        # the ring hashes the workers' URLs, whose ports are random: 16 sessions all on
        # one of two workers has odds of about 2 in 65536 (four sessions had 1 in 8)
        sessions = [f"session-{i}" for i in range(16)]
        for session in sessions:
            seen = set()
            for turn in range(2):
                body = {"prompt": f"{session} {LONG} turn {turn}", "max_tokens": 4}
                response = post(cluster.url, "/v1/completions", body, session)
                assert response.status_code == 200
                seen.add(response.headers["x-ember-prefill-worker"])
            assert len(seen) == 1
            homes[session] = seen.pop()
        assert len(set(homes.values())) == 2  # the sessions hash onto both workers

        def anonymous(i):
            body = {"prompt": f"{i} " + LONG * 2, "max_tokens": 4}
            return post(cluster.url, "/v1/completions", body).headers["x-ember-prefill-worker"]

        with ThreadPoolExecutor(6) as pool:
            placed = list(pool.map(anonymous, range(12)))
        assert set(placed) == set(cluster.urls("prefill"))  # spread by load
        decisions = cluster.load()["decisions"]
        assert decisions["prefill:affinity"] == 32 and decisions["prefill:least-load"] >= 12
        cluster.wait_no_blocks()
    finally:
        cluster.stop()


def test_a_failed_transfer_is_recomputed_and_leaves_no_block(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    reference = EmberServer(model, *WORKER_ARGS)
    cluster = None
    try:
        cluster = Up(model, "--prefill", "1", "--decode", "1",
                     "--kv-transport", "fake", "--kv-fake-fault", "fail")  # fmt: skip
        # recomputed as one prefill: the same tokens, logprobs equal up to rounding
        assert_answers_alike(cluster, reference, requests_made_of(LONG))
        decode_load = cluster.worker_load(cluster.urls("decode")[0])
        assert decode_load["kv_transfer"]["loads_failed"] == 2
        assert decode_load["num_prompt_tokens_computed"] > 0  # recomputed there
        cluster.wait_no_blocks(timeout=5)  # released at once, not after the hold timeout
        prefill_load = cluster.worker_load(cluster.urls("prefill")[0])
        assert prefill_load["kv_transfer"]["holds_expired"] == 0
    finally:  # a cluster that failed to start has stopped what it started
        reference.stop()
        if cluster is not None:
            cluster.stop()


def test_decode_workers_over_two_ranks_take_a_one_rank_prefill_workers_kv(tiny_checkpoint):
    """`-tp 2 --prefill-tensor-parallel-size 1`: the decode worker reshards each prompt's
    KV over its two ranks as it arrives, and answers as one mixed process does."""
    model = str(tiny_checkpoint("llama"))
    reference = EmberServer(model, *WORKER_ARGS)
    cluster = None
    try:
        cluster = Up(model, "--prefill", "1", "--decode", "1", "--tensor-parallel-size", "2",
                     "--prefill-tensor-parallel-size", "1")  # fmt: skip
        made = requests_made_of(LONG) + requests_made_of("Short one.")
        assert_answers_alike(cluster, reference, made)
        prefill_load = cluster.worker_load(cluster.urls("prefill")[0])
        decode_load = cluster.worker_load(cluster.urls("decode")[0])
        assert prefill_load["parallel"]["tensor_parallel_size"] == 1
        assert decode_load["parallel"]["tensor_parallel_size"] == 2
        transfers = decode_load["kv_transfer"]
        assert (transfers["loads_ok"], transfers["loads_failed"]) == (len(made), 0)
        assert decode_load["num_prompt_tokens_computed"] == 0
        cluster.wait_no_blocks(timeout=5)
    finally:
        reference.stop()
        if cluster is not None:
            cluster.stop()


# -- one prefill + one decode worker, and a mixed worker as the reference -------------------


@pytest.fixture(scope="module")
def pd(tiny_checkpoint):
    model = str(tiny_checkpoint("llama"))
    reference = EmberServer(model, *WORKER_ARGS)
    try:  # the reference must not outlive a cluster that failed to start
        cluster = Up(model, "--prefill", "1", "--decode", "1")
        try:
            yield cluster, reference
        finally:
            cluster.stop()
    finally:
        reference.stop()


def test_disaggregated_output_and_usage_match_one_mixed_worker(pd):
    cluster, reference = pd
    for prompt in (LONG, LONG + "Again.", "Short one."):  # later ones hit the prefix cache
        for path, body in requests_made_of(prompt):
            want = post(reference.url, path, body).json()
            response = post(cluster.url, path, body)
            assert response.status_code == 200
            got = response.json()
            assert "kv_transfer_params" not in got
            assert got["choices"] == want["choices"]  # text, logprobs, finish reason
            assert got["usage"] == want["usage"]  # cached_tokens: the prefill worker's hit
            assert response.headers["x-ember-prefill-worker"] == cluster.urls("prefill")[0]
            assert response.headers["x-ember-worker"] == cluster.urls("decode")[0]
            assert stream(cluster.url, path, body)[:2] == stream(reference.url, path, body)[:2]
    assert post(cluster.url, "/v1/completions", {"prompt": LONG})  # warm the cache once more
    decode_load = cluster.worker_load(cluster.urls("decode")[0])
    assert decode_load["num_prompt_tokens_computed"] == 0  # every prompt came by transfer
    assert decode_load["kv_transfer"]["loads_ok"] >= 12
    assert decode_load["kv_transfer"]["loads_failed"] == 0
    cluster.wait_no_blocks()


def test_a_request_that_ends_on_the_prefill_worker_is_answered_from_there(pd):
    cluster, reference = pd
    body = {"prompt": "One token only.", "max_tokens": 1, "temperature": 0}
    for response in (post(cluster.url, "/v1/completions", body),
                     post(cluster.url, "/v1/completions", dict(body, stream=True))):  # fmt: skip
        assert response.status_code == 200
        assert response.headers["x-ember-worker"] == cluster.urls("prefill")[0]
        assert "kv_transfer_params" not in response.text
    want = post(reference.url, "/v1/completions", body).json()
    assert post(cluster.url, "/v1/completions", body).json()["choices"] == want["choices"]
    cluster.wait_no_blocks()


def test_bad_requests_get_the_workers_errors(pd):
    cluster, _ = pd
    response = post(cluster.url, "/v1/completions", {"prompt": "x", "max_tokens": -1})
    assert response.status_code == 400 and response.json()["error"]["param"] == "max_tokens"
    response = post(cluster.url, "/v1/completions", {"prompt": "x", "kv_transfer_params": 3})
    assert response.status_code == 400
    response = post(cluster.url, "/v1/completions", {"prompt": "x", "n": 2, "max_tokens": 3})
    assert response.status_code == 200 and len(response.json()["choices"]) == 2  # runs whole


def test_killing_the_decode_worker_moves_new_requests_to_the_prefill_worker(pd):
    cluster, _ = pd
    (decode_url,) = cluster.urls("decode")
    serve_pid = pid_serving(decode_url)
    body = {"prompt": LONG, "max_tokens": 8, "temperature": 0}
    with ThreadPoolExecutor(4) as pool:
        running = [pool.submit(post, cluster.url, "/v1/completions", body) for _ in range(4)]
        for pid in [*child_pids(serve_pid), serve_pid]:
            os.kill(pid, signal.SIGKILL)
        after = [pool.submit(post, cluster.url, "/v1/completions", body) for _ in range(6)]
        statuses = [f.result().status_code for f in after]
        for f in running:
            f.result()  # these may have failed with the worker; they must not hang
    assert statuses == [200] * 6
    del cluster.workers[decode_url]
    cluster.wait_no_blocks()


def test_every_listening_socket_is_on_loopback(pd):
    """Nothing of a default cluster listens beyond this machine: the router, the workers'
    HTTP and their KV endpoints all bind 127.0.0.1."""
    import subprocess
    import time

    cluster, _ = pd
    deadline = time.monotonic() + 60  # (a worker killed by an earlier test is restarting)
    while True:
        tree, todo = set(), [cluster.process.pid]
        while todo:
            pid = todo.pop()
            tree.add(pid)
            todo += child_pids(pid)
        listening = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True).stdout
        ours = [line for line in listening.splitlines()
                if any(f"pid={p}," in line for p in tree)]  # fmt: skip
        if len(ours) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(ours) >= 4  # the router, two workers' HTTP, the prefill worker's KV endpoint
    for line in ours:
        assert line.split()[3].startswith(("127.0.0.1:", "[::1]:")), line

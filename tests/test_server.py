"""`ember serve` on a tiny checkpoint, driven with the official openai SDK and raw HTTP.

The server runs as real processes (API + engine core); outputs are compared with the
offline engine on the same checkpoint, usage numbers are checked exactly.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from ember import LLM, SamplingParams
from server_utils import EmberServer, child_pids, pid_alive

KV = ["--kv-cache-memory", "16M", "--max-model-len", "512"]
PROMPT = "The quick brown fox jumps over the lazy dog. Agents resend their whole context"


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = EmberServer(str(tiny_checkpoint("llama")), *KV, "--served-model-name", "tiny")
    yield srv
    assert srv.stop() == 0
    assert not pid_alive(srv.core_pid)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_checkpoint):
    return LLM(str(tiny_checkpoint("llama")), kv_cache_memory=1 << 24, max_model_len=512)


def test_models_lists_the_served_name(client):
    (model,) = client.models.list().data
    assert model.id == "tiny"


def test_completion_matches_the_offline_engine_and_streams_the_same(client, offline):
    expected = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    )[0]
    extra = {"ignore_eos": True}
    result = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, extra_body=extra
    )
    assert result.choices[0].text == expected.outputs[0].text
    assert result.choices[0].finish_reason == "length"
    assert result.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert result.usage.completion_tokens == 20
    assert result.usage.total_tokens == len(expected.prompt_token_ids) + 20

    chunks = list(
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra,
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and not chunks[-1].choices


def test_token_id_prompts_and_prompt_lists(client, offline):
    ids = offline.get_tokenizer().encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = offline.generate([ids], params)[0].outputs[0].text
    result = client.completions.create(
        model="tiny",
        prompt=[ids, ids],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in result.choices] == [0, 1]
    assert all(c.text == expected for c in result.choices)
    assert result.usage.prompt_tokens == 2 * len(ids)


def test_chat_usage_is_exact_and_stream_equals_non_stream(client, offline):
    messages = [{"role": "user", "content": "Agents resend their whole context every turn."}]
    prompt_ids = offline.get_tokenizer().apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    expected = offline.generate(
        [list(prompt_ids)], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0]
    kwargs = dict(model="tiny", messages=messages, max_tokens=12, temperature=0,
                  extra_body={"ignore_eos": True})  # fmt: skip
    result = client.chat.completions.create(**kwargs)
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == expected.outputs[0].text
    assert result.usage.prompt_tokens == len(prompt_ids)
    assert result.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.outputs[0].text
    assert chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_cached_tokens_are_exact_in_both_modes(client):
    prompt = "0123456789 " * 9 + "unique prefix for the cache test"
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    first = client.completions.create(**kwargs)
    num_prompt = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(**kwargs)
    assert again.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 16 * 16 > 0
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 16 * 16
    salted = client.completions.create(**kwargs, extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_n_seed_and_stop(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=10, temperature=1.0, n=3,
                  extra_body={"ignore_eos": True})  # fmt: skip
    first = client.completions.create(**kwargs, seed=7)
    again = client.completions.create(**kwargs, seed=7)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({c.text for c in first.choices}) > 1  # siblings draw differently
    assert first.usage.completion_tokens == 30
    assert first.usage.prompt_tokens == again.usage.prompt_tokens  # counted once, not n times

    greedy = (
        client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=30,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .text
    )
    stop = greedy[5:8]
    cut = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=30, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    assert cut.text == greedy[: greedy.index(stop)]
    assert cut.finish_reason == "stop"


def test_logprobs_match_the_offline_engine(client, offline):
    expected = offline.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    )[0].outputs[0]
    result = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    ).choices[0]  # fmt: skip
    chosen = [next(iter(entry.values())) for entry in expected.logprobs]
    assert result.logprobs.token_logprobs == pytest.approx(chosen, abs=1e-5)
    best = [max(entry.values()) for entry in expected.logprobs]
    for top, value in zip(result.logprobs.top_logprobs, best, strict=True):
        assert 1 <= len(top) <= 2  # keyed by text: two byte tokens may both print as "�"
        assert max(top.values()) == pytest.approx(value, abs=1e-5)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3,
    ).choices[0]  # fmt: skip
    assert len(chat.logprobs.content) == 3
    for item in chat.logprobs.content:
        assert len(item.top_logprobs) == 3
        assert item.top_logprobs[0].logprob >= item.logprob - 1e-6  # greedy took the best


def test_session_header_is_echoed(server):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    headers = {"x-session-affinity": "session-42"}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers)
    assert response.headers["x-session-affinity"] == "session-42"
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=dict(body, stream=True), headers=headers
    ) as response:
        assert response.headers["x-session-affinity"] == "session-42"
        response.read()


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({"prompt": "hi", "temperature": -1}, "temperature", ["[0, 2]", "-1"]),
        ({"prompt": "hi", "top_p": 0}, "top_p", ["(0, 1]"]),
        ({"prompt": "hi", "n": 0}, "n", ["[1, 128]"]),
        ({"prompt": "hi", "max_tokens": 600}, "max_tokens", ["600", "512"]),
        ({"prompt": "hi", "logprobs": 50}, "logprobs", ["[0, 20]"]),
        ({"prompt": [10**6]}, "prompt", ["token ids"]),
        ({}, "prompt", ["required"]),
    ],
)
def test_invalid_parameters_are_400_naming_them(server, body, param, words):
    response = httpx.post(f"{server.url}/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert all(w in error["message"] for w in words), error["message"]


def test_context_overflow_and_other_errors(server, client):
    long = " ".join(f"x{i}" for i in range(400))  # well over the 512-token context
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=long, max_tokens=4)
    assert "max_model_len" in info.value.body["message"] and "512" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=[5] * 200, max_tokens=400)
    message = info.value.body["message"]
    assert "400" in message and "200" in message and "512" in message  # both numbers, the limit
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-model", prompt="hi")
    assert info.value.body["code"] == "model_not_found"
    response = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b'{"model": "tiny", "messages": [',
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    bad_role = {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=bad_role)
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("messages")


def test_disconnect_mid_stream_frees_blocks(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 400, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as response:
        lines = response.iter_lines()
        for _ in range(5):
            next(lines)
        assert server.load()["kv_blocks_used"] > 0
    load = server.wait_idle()
    assert load["num_running"] == 0 and load["kv_blocks_used"] == 0


def test_disconnect_of_a_non_streaming_request_aborts_it(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 450, "n": 4, "ignore_eos": True}
    aborted_before = _aborted(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.2))
    load = server.wait_idle(timeout=10)
    assert load["num_running"] == 0 and load["kv_blocks_used"] == 0
    assert _aborted(server) == aborted_before + 1  # it was cut short, not run to the end


def _aborted(server) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "ember_requests_total" and sample.labels["finish_reason"] == "abort":
                return sample.value
    return 0.0


def test_load_and_metrics(server, client):
    client.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0)
    load = server.load()
    assert set(load) >= {
        "num_waiting", "num_running", "num_queued_prefill_tokens", "kv_blocks_used",
        "kv_blocks_total", "prefix_cache_queries", "prefix_cache_hits",
    }  # fmt: skip
    assert load["prefix_cache_queries"] > 0 and load["kv_blocks_total"] > 0

    def scrape():
        text = httpx.get(f"{server.url}/metrics").text
        return {
            (s.name, s.labels.get("finish_reason")): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    before = scrape()
    client.completions.create(
        model="tiny", prompt="hello", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    after = scrape()
    assert (
        after[("ember_generation_tokens_total", None)]
        - before[("ember_generation_tokens_total", None)]
        == 5
    )
    assert (
        after[("ember_requests_total", "length")] - before[("ember_requests_total", "length")] == 1
    )
    # one step per token (a prefill, then decodes), each timed
    assert after[("ember_engine_steps", None)] - before[("ember_engine_steps", None)] == 5
    assert after[("ember_engine_step_seconds", None)] > before[("ember_engine_step_seconds", None)]
    # --target-itl-ms auto: a share of a 512-token prompt's predicted time, never off
    assert after[("ember_engine_target_itl_ms", None)] > 0
    assert (
        after[("ember_time_to_first_token_seconds_count", None)]
        > before[("ember_time_to_first_token_seconds_count", None)]
    )
    for name in ("ember_num_requests_running", "ember_kv_cache_usage_ratio",
                 "ember_prompt_tokens_cached_total", "ember_request_queue_time_seconds_count",
                 "ember_inter_token_latency_seconds_count", "ember_e2e_request_latency_seconds_count"):  # fmt: skip
        assert (name, None) in after


def test_api_key_is_required_when_set(tiny_checkpoint):
    srv = EmberServer(str(tiny_checkpoint("llama")), *KV, "--api-key", "sesame")
    try:
        body = {"prompt": "hi", "max_tokens": 1}
        assert httpx.post(f"{srv.url}/v1/completions", json=body).status_code == 401
        wrong = {"Authorization": "Bearer nope"}
        response = httpx.post(f"{srv.url}/v1/completions", json=body, headers=wrong)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
        good = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="sesame", max_retries=0)
        assert good.completions.create(
            model=good.models.list().data[0].id, prompt="hi", max_tokens=1
        )
        assert httpx.get(f"{srv.url}/health").status_code == 200  # probes stay open
    finally:
        assert srv.stop() == 0


def test_queue_limit_answers_429(tiny_checkpoint):
    srv = EmberServer(
        str(tiny_checkpoint("llama")), "--kv-cache-memory", "16M", "--max-model-len", "1024",
        "--max-num-seqs", "1", "--max-queued-requests", "1",
    )  # fmt: skip
    body = {"prompt": PROMPT, "max_tokens": 900, "ignore_eos": True}

    def post(_):
        return httpx.post(f"{srv.url}/v1/completions", json=body, timeout=120)

    try:
        with ThreadPoolExecutor(6) as pool:
            first = pool.submit(post, 0)
            deadline = time.monotonic() + 30
            while srv.load()["num_running"] == 0 and time.monotonic() < deadline:
                time.sleep(0.01)  # the first runs (one sequence at a time) ...
            # ... then five at once: one may wait, the rest are refused
            rest = list(pool.map(post, range(5)))
            responses = [first.result(), *rest]
        codes = sorted(r.status_code for r in responses)
        assert codes.count(200) >= 2 and codes.count(429) >= 1 and set(codes) == {200, 429}
        for response in responses:
            if response.status_code == 429:
                assert response.json()["error"]["type"] == "rate_limit_error"
            else:
                assert response.json()["usage"]["completion_tokens"] == 900
        assert srv.wait_idle()["kv_blocks_used"] == 0
    finally:
        assert srv.stop() == 0


def test_a_dead_engine_is_restarted_with_503s_meanwhile(tiny_checkpoint):
    srv = EmberServer(str(tiny_checkpoint("llama")), *KV)
    core_pid = srv.core_pid
    try:
        body = {"prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
        events: list[str] = []
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    if len(events) == 2:
                        os.kill(core_pid, signal.SIGKILL)
        assert events[-1] == "data: [DONE]"  # the stream in flight ends with a clear error
        error = json.loads(events[-2][6:])["error"]
        assert error["code"] == "engine_stopped" and "restarting" in error["message"]
        health = httpx.get(f"{srv.url}/health")  # the first restart waits 1 s
        assert health.status_code == 503 and "restarting" in health.json()["error"]["message"]
        response = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"})
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "engine_not_running"  # a router retries
        deadline = time.monotonic() + 60
        while httpx.get(f"{srv.url}/health").status_code != 200:
            assert time.monotonic() < deadline, "the engine did not come back"
            time.sleep(0.1)
        response = httpx.post(f"{srv.url}/v1/completions", json={"prompt": "hi"}, timeout=30)
        assert response.status_code == 200
        assert srv.load()["engine_restarts"] == 1
        assert "ember_engine_restarts{" in httpx.get(f"{srv.url}/metrics").text
        (new_core,) = child_pids(srv.process.pid)
        assert new_core != core_pid and not pid_alive(core_pid)
    finally:
        assert srv.stop() == 0
    assert not child_pids(srv.process.pid)


def test_with_no_restart_left_a_dead_engine_ends_the_server(tiny_checkpoint):
    srv = EmberServer(str(tiny_checkpoint("llama")), *KV, "--engine-restarts", "0")
    os.kill(srv.core_pid, signal.SIGKILL)
    assert srv.process.wait(30) == 1  # a supervisor (ember up, Kubernetes) starts it again
    assert not child_pids(srv.process.pid)


def test_sigterm_ends_in_flight_streams_cleanly(tiny_checkpoint):
    srv = EmberServer(
        str(tiny_checkpoint("llama")), "--kv-cache-memory", "16M", "--max-model-len", "1024",
        "--shutdown-timeout", "0",
    )  # fmt: skip
    body = {"prompt": PROMPT, "max_tokens": 900, "stream": True, "ignore_eos": True}
    events: list[str] = []

    def read():
        with httpx.stream("POST", f"{srv.url}/v1/completions", json=body, timeout=60) as r:
            events.extend(line for line in r.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + 20
    while not events and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.stop() == 0
    reader.join(timeout=30)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert "shutting down" in last["error"]["message"]  # cut short with a clear error
    assert not pid_alive(srv.core_pid)

"""Untrusted input against a real `ember serve`: every bad value is a 400 naming its field,
fields ember does not implement are refused, and no bad request leaks the queue counters.

Bodies are sent as raw JSON (Python's json writes Infinity, NaN and lone surrogates,
which FastAPI's parser accepts), so the server sees exactly what a hostile client sends.
"""

from __future__ import annotations

import json

import httpx
import pytest

from server_utils import EmberServer

KV = ["--kv-cache-memory", "16M", "--max-model-len", "512"]
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
TEXT = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
INF, NAN = float("inf"), float("nan")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    srv = EmberServer(
        str(tiny_checkpoint("llama")), *KV, "--served-model-name", "tiny",
        "--max-queued-requests", "4",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    content = json.dumps(body)  # allow_nan and ensure_ascii: Infinity, NaN, "\ud800" as is
    headers = {"content-type": "application/json"}
    return httpx.post(f"{server.url}{path}", content=content, headers=headers, timeout=60)


def assert_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == ("rate_limit_error" if status == 429 else "invalid_request_error")
    assert error["param"] == param, error
    return error


OUT_OF_RANGE = [
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop_token_ids": [10**30]}, "stop_token_ids.0"),
    ({"stop_token_ids": [512]}, "stop_token_ids"),  # the tiny vocabulary has 512
    ({"temperature": 1e308}, "temperature"),
    ({"temperature": INF}, "temperature"),
    ({"temperature": -INF}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 10**9}, "top_k"),
    ({"top_k": 513}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": NAN}, "min_p"),
    ({"presence_penalty": INF}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"n": 0}, "n"),
    ({"n": 129}, "n"),
    ({"n": 1000}, "n"),
    ({"n": 1.5}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**30}, "max_tokens"),
    ({"max_tokens": 600}, "max_tokens"),  # beyond the context
    ({"logprobs": 21}, "logprobs"),
    ({"prompt": [10**30]}, "prompt.0"),
    ({"prompt": [-1]}, "prompt.0"),
    ({"prompt": [100000]}, "prompt"),  # beyond the vocabulary
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt.0"),
    ({"prompt": ["hi", ""]}, "prompt.1"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"cache_salt": "\udfff"}, "cache_salt"),
    ({"stop": ["\ud800"]}, "stop"),
    ({"stop": ""}, "stop"),
]


@pytest.mark.parametrize("fields, param", OUT_OF_RANGE)
def test_out_of_range_values_are_400_naming_the_field(server, fields, param):
    error = assert_error(post(server, {**TEXT, **fields}), 400, param)
    assert error["code"] == "invalid_value"
    chat = post(server, {**CHAT, **fields}, "/v1/chat/completions")
    if "prompt" not in fields:
        assert_error(chat, 400, param)


def test_chat_ranges_and_messages(server):
    path = "/v1/chat/completions"
    for fields, param in [
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"max_completion_tokens": 2**64}, "max_completion_tokens"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ]:
        assert_error(post(server, {**CHAT, **fields}, path), 400, param)


@pytest.mark.parametrize(
    "path, fields, param",
    [
        ("/v1/completions", {"logit_bias": {"x": 1}}, "logit_bias.x"),
        ("/v1/completions", {"logit_bias": {"5": 101}}, "logit_bias.5"),
        ("/v1/completions", {"logit_bias": [1]}, "logit_bias"),
        ("/v1/completions", {"best_of": 2}, "best_of"),
        ("/v1/completions", {"suffix": "end"}, "suffix"),
        ("/v1/completions", {"guided_json": {"type": "object"}}, "guided_json"),
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
        ("/v1/chat/completions", {"reasoning_effort": "high"}, "reasoning_effort"),
    ],
)
def test_fields_ember_does_not_implement_are_refused_not_ignored(server, path, fields, param):
    body = {**(TEXT if path == "/v1/completions" else CHAT), **fields}
    assert_error(post(server, body, path), 400, param)


def test_edge_values_are_served(server):
    for fields in [
        {"logit_bias": {}, "min_tokens": 0, "echo": False, "best_of": 1, "suffix": ""},
        {"temperature": 2, "top_p": 1, "top_k": 512, "presence_penalty": -2, "n": 3},
        {"stop_token_ids": [511], "repetition_penalty": 2, "logprobs": 20},
    ]:
        assert post(server, {**TEXT, **fields}).status_code == 200, fields
    for seed in (-1, -(2**63), 2**63 - 1):  # any int64; n > 1 seeds seed, seed + 1, ...
        body = {**TEXT, "seed": seed, "n": 2, "temperature": 1, "max_tokens": 8}
        first, again = post(server, body).json(), post(server, body).json()
        assert [c["text"] for c in first["choices"]] == [c["text"] for c in again["choices"]]
    chat = {**CHAT, "modalities": ["text"], "functions": [], "parallel_tool_calls": False}
    assert post(server, chat, "/v1/chat/completions").status_code == 200


def test_bad_requests_leak_nothing_and_never_lock_the_queue(server):
    too_long = {"prompt": "hi " * 600}  # refused after tokenizing (max_model_len 512)
    for i in range(30):  # the queue limit is 4: each leak used to hold a slot for ever
        bad = [
            {"seed": 2**70}, {"stop_token_ids": [10**30]}, {"cache_salt": "\ud800"},
            {"stop_token_ids": [512]}, too_long,
        ][i % 5]  # fmt: skip
        assert post(server, {**TEXT, **bad}).status_code == 400
    assert post(server, TEXT).status_code == 200
    load = server.wait_idle()
    assert load["num_waiting"] == load["num_running"] == load["kv_blocks_used"] == 0
    assert load["num_preparing"] == 0  # each was counted on its way to the engine


def test_405_names_the_allowed_methods(server):
    response = httpx.get(f"{server.url}/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"


def test_the_schema_says_what_is_refused(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()["components"]["schemas"]
    prompt = schema["CompletionRequest"]["properties"]["prompt"]["oneOf"]
    assert prompt[0] == {"type": "string", "minLength": 1}
    assert all(form["minItems"] == 1 for form in prompt[1:])
    props = schema["CompletionRequest"]["properties"]
    temperature = props["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0, 2)
    assert (props["n"]["minimum"], props["n"]["maximum"]) == (1, 128)

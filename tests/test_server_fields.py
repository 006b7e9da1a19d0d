"""Sampling fields through a real `ember serve`: what a client sees of logit_bias,
min_tokens, stop, seeds with n > 1, parallel_tool_calls and continuous usage stats."""

from __future__ import annotations

import json
import random

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server_utils import tiny_server

KV = ["--kv-cache-memory", "16M", "--max-model-len", "512"]
PROMPT = [(7 * i) % 500 + 3 for i in range(40)]
GREEDY = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    yield from tiny_server(tiny_checkpoint, *KV)


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return AutoTokenizer.from_pretrained(tiny_checkpoint("llama"))


@pytest.fixture(scope="module")
def first_greedy_token(tiny_checkpoint) -> int:
    """transformers' greedy choice after PROMPT."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint("llama"), dtype=torch.float32)
    with torch.inference_mode():
        return int(model(torch.tensor([PROMPT])).logits[0, -1].argmax())


def post(server, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60)


def completion(server, **fields) -> dict:
    response = post(server, {**GREEDY, **fields})
    assert response.status_code == 200, response.text
    return response.json()


def chat(server, **fields) -> dict:
    response = post(server, {**CHAT, "temperature": 0, **fields}, "/v1/chat/completions")
    assert response.status_code == 200, response.text
    return response.json()


# --- logit_bias --------------------------------------------------------------------------


def test_logit_bias_forces_and_forbids_tokens(server, tokenizer, first_greedy_token):
    forced = completion(server, logit_bias={"42": 100})["choices"][0]["text"]
    assert forced == tokenizer.decode([42] * 8)
    first = tokenizer.decode([first_greedy_token])
    plain = completion(server, logprobs=0)["choices"][0]["logprobs"]["tokens"]
    assert plain[0] == first
    bias = {str(first_greedy_token): -100}
    banned = completion(server, logprobs=0, logit_bias=bias)["choices"][0]["logprobs"]["tokens"]
    assert banned[0] != first


def test_chat_logit_bias(server, tokenizer):
    forced = chat(server, logit_bias={"42": 100}, max_tokens=5)["choices"][0]["message"]
    assert forced["content"] == tokenizer.decode([42] * 5)


def test_logit_bias_outside_the_vocabulary_is_a_400(server):
    for path, base in [("/v1/completions", GREEDY), ("/v1/chat/completions", CHAT)]:
        response = post(server, {**base, "logit_bias": {"512": 1}}, path)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "logit_bias"


# --- min_tokens --------------------------------------------------------------------------


def test_min_tokens_holds_off_eos_and_stop_strings(server, tokenizer):
    eos = {"1": 100}  # EOS, forced
    ended = completion(server, logit_bias=eos, ignore_eos=False)
    assert ended["usage"]["completion_tokens"] == 1
    held = completion(server, logit_bias=eos, ignore_eos=False, min_tokens=5)
    assert held["usage"]["completion_tokens"] == 6  # five, then EOS
    assert held["choices"][0]["finish_reason"] == "stop"
    message = chat(server, logit_bias=eos, min_tokens=3)
    assert message["usage"]["completion_tokens"] == 4
    piece = tokenizer.decode([42])
    body = {**GREEDY, "logit_bias": {"42": 100}, "stop": piece, "min_tokens": 3}
    choice = completion(server, **body)["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == (piece * 3, piece)
    events = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}).text
    chunks = [json.loads(line[6:]) for line in events.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == piece * 3


@pytest.mark.parametrize("fields", [{"min_tokens": 9}, {"min_tokens": -1}])
def test_min_tokens_out_of_range_is_a_400(server, fields):
    for path, base in [("/v1/completions", GREEDY), ("/v1/chat/completions", CHAT)]:
        response = post(server, {**base, **fields}, path)  # max_tokens is 8
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "min_tokens"


# --- parallel_tool_calls -----------------------------------------------------------------

PICK = {
    "type": "function",
    "function": {
        "name": "pick",
        "parameters": {
            "type": "object",
            "properties": {"x": {"enum": ["a", "b"]}},
            "required": ["x"],
            "additionalProperties": False,
        },
    },
}


def test_required_tool_choice_without_parallel_calls_makes_one_call(server, tokenizer):
    # "]" pushed down: left free, the model keeps adding calls until max_tokens
    never_close = {str(tokenizer.convert_tokens_to_ids("]")): -100}
    body = dict(tools=[PICK], tool_choice="required", logit_bias=never_close, max_tokens=40)
    free = chat(server, **body)["choices"][0]
    assert free["finish_reason"] == "length"
    single = chat(server, **body, parallel_tool_calls=False)["choices"][0]
    assert single["finish_reason"] == "tool_calls"
    (call,) = single["message"]["tool_calls"]
    assert call["function"]["name"] == "pick"
    assert json.loads(call["function"]["arguments"])["x"] in ("a", "b")


def test_auto_tool_choice_without_parallel_calls_returns_the_first_call():
    from ember.server.chat import tool_plan
    from ember.server.parsers import ChatParsers
    from ember.server.parsers.base import merge_calls
    from ember.server.protocol import ChatCompletionRequest
    from ember.server.serving_chat import _ChoiceText

    text = "".join(
        f'<tool_call>{{"name": "pick", "arguments": {{"x": "{x}"}}}}</tool_call>' for x in "ab"
    )
    for parallel, expected in [(True, ['{"x": "a"}', '{"x": "b"}']), (False, ['{"x": "a"}'])]:
        request = ChatCompletionRequest(messages=CHAT["messages"], tools=[PICK])
        request.parallel_tool_calls = parallel

        def choice_text(request=request):
            parser = ChatParsers("hermes").output_parser("", request.tools, reasoning=False)
            return _ChoiceText(tool_plan(request), parser, random.Random("chatcmpl-1/0"))

        whole = choice_text()
        calls = merge_calls(whole.feed(text, finished=True).calls)
        assert [c["function"]["arguments"] for c in calls] == expected
        ids = [c["id"] for c in calls]  # drawn from the request's id: alike on any worker
        streamed = choice_text()
        pieces = [
            streamed.feed(text[i : i + 7], i + 7 >= len(text)) for i in range(0, len(text), 7)
        ]
        calls = merge_calls([c for piece in pieces for c in piece.calls])
        assert [c["function"]["arguments"] for c in calls] == expected
        assert [c["id"] for c in calls] == ids and len(set(ids)) == len(ids)
        assert whole.finish_reason("stop") == streamed.finish_reason("stop") == "tool_calls"


# --- stream_options.continuous_usage_stats -----------------------------------------------


def stream_chunks(server, body: dict, path: str = "/v1/completions") -> list[dict]:
    text = httpx.post(f"{server.url}{path}", json={**body, "stream": True}, timeout=60).text
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(server, path):
    if path == "/v1/completions":  # 2 prompts, 2 choices each, 8 tokens each
        body, num_tokens = {**GREEDY, "prompt": [PROMPT, PROMPT[:20]], "n": 2}, 32
    else:
        body, num_tokens = {**CHAT, "temperature": 0, "ignore_eos": True, "n": 2}, 16
    final = post(server, body, path).json()["usage"]
    del final["prompt_tokens_details"]  # the prefix cache holds more the second time
    options = {"continuous_usage_stats": True, "include_usage": True}
    chunks = stream_chunks(server, {**body, "stream_options": options}, path)
    assert chunks[-1]["usage"].items() >= final.items() and not chunks[-1]["choices"]
    counted = [c["usage"] for c in chunks[:-1]]
    assert len(counted) == len(chunks) - 1  # every chunk has one
    assert {u["prompt_tokens"] for u in counted} == {final["prompt_tokens"]}
    done = [u["completion_tokens"] for u in counted]
    assert done == sorted(done) and done[-1] == final["completion_tokens"] == num_tokens
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in counted)
    plain = stream_chunks(server, {**body, "stream_options": {"include_usage": True}}, path)
    assert [c for c in plain if c.get("usage")] == [plain[-1]]


# --- stop: up to 64 strings of up to 1024 characters --------------------------------------


def test_stop_takes_64_strings_of_1024_characters(server, tokenizer):
    piece = tokenizer.decode([42])
    stops = [f"{i:04d}" * 256 for i in range(63)] + [piece]
    body = {**GREEDY, "logit_bias": {"42": 100}, "stop": stops}
    choice = completion(server, **body)["choices"][0]
    assert (choice["text"], choice["stop_reason"]) == ("", piece)
    for stop, param in [
        (stops + ["x"], "stop"),
        (stops[:3] + ["x" * 1025], "stop.3"),
        ("x" * 1025, "stop"),
        ([""], "stop.0"),
    ]:
        for path, base in [("/v1/completions", GREEDY), ("/v1/chat/completions", CHAT)]:
            response = post(server, {**base, "stop": stop}, path)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == param


# --- seed with n > 1 ---------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_the_n_choices_of_a_seeded_request_are_seeded_seed_seed_plus_1_and_so_on(server, path):
    base = GREEDY if path == "/v1/completions" else {**CHAT, "ignore_eos": True}
    sampled = {**base, "temperature": 1.0, "max_tokens": 12}

    def texts(**fields) -> list[str]:
        response = post(server, {**sampled, **fields}, path)
        assert response.status_code == 200, response.text
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return [c.get("text", c.get("message", {}).get("content")) for c in choices]

    together = texts(n=3, seed=2**63 - 2)  # seeds 2**63 - 2, 2**63 - 1, then -2**63
    alone = [texts(seed=seed)[0] for seed in (2**63 - 2, 2**63 - 1, -(2**63))]
    assert together == alone
    assert len(set(together)) == 3
    events = stream_chunks(server, {**sampled, "n": 3, "seed": 2**63 - 2}, path)
    streamed = ["", "", ""]
    for event in events:
        for choice in event["choices"]:
            piece = choice.get("text", choice.get("delta", {}).get("content"))
            streamed[choice["index"]] += piece or ""
    assert streamed == together


def test_max_completion_tokens_wins_over_max_tokens(server):
    def num_tokens(**fields) -> int:
        return chat(server, ignore_eos=True, **fields)["usage"]["completion_tokens"]

    assert num_tokens(max_tokens=7) == 7
    assert num_tokens(max_tokens=7, max_completion_tokens=3) == 3
    assert num_tokens(max_tokens=None, max_completion_tokens=5) == 5


# --- kv_retention ------------------------------------------------------------------------


def test_kv_retention_takes_session_only(server):
    for path, base in [("/v1/completions", GREEDY), ("/v1/chat/completions", CHAT)]:
        assert post(server, {**base, "kv_retention": "session"}, path).status_code == 200
        response = post(server, {**base, "kv_retention": "forever"}, path)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "kv_retention"

"""POST /v1/messages (Anthropic's Messages API) on `ember serve` and through `ember up`,
driven with the official anthropic SDK: the same greedy text as the chat endpoint for the
same conversation, Anthropic's usage and stop reasons, tool use and tool results,
Anthropic-shaped errors, `x-api-key`, and the stream's events on their own."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest
from starlette.datastructures import Headers

from ember.server.guard import Access
from ember.server.serving_messages import _EngineView, _EventWriter
from server_utils import Up, tiny_server

KV = ["--kv-cache-memory", "16M", "--max-model-len", "1024", "--block-size", "8"]
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "Current weather for a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "unit": {"enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
AS_CHAT_TOOL = {
    "type": "function",
    "function": {k if k != "input_schema" else "parameters": v for k, v in WEATHER.items()},
}


@pytest.fixture(scope="module")
def server(tiny_checkpoint):
    yield from tiny_server(tiny_checkpoint, *KV)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def chat(server, messages: list[dict], **fields) -> dict:
    body = {"model": "tiny", "messages": messages, **GREEDY, **fields}
    response = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def fresh(text: str) -> str:
    """`text` behind a prefix no earlier prompt has (so nothing of it is cached yet)."""
    return f"{uuid.uuid4().hex} {text}"


def test_text_and_usage_equal_the_chat_endpoints(server, client):
    question = fresh("The quick brown fox jumps over the lazy dog, and then?")
    system = "You answer briefly."
    reference = chat(server, [{"role": "system", "content": system},
                              {"role": "user", "content": question}], max_tokens=12)  # fmt: skip
    text = reference["choices"][0]["message"]["content"]
    num_prompt = reference["usage"]["prompt_tokens"]

    kwargs = dict(model="tiny", max_tokens=12, messages=[{"role": "user", "content": question}],
                  extra_body=GREEDY)  # fmt: skip
    message = client.messages.create(system=system, **kwargs)
    assert message.type == "message" and message.role == "assistant" and message.model == "tiny"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.content[0].text == text
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    # the prompt ran before (the chat request): as Anthropic counts, input_tokens leave the
    # cached tokens out, and the two add up to the whole prompt
    usage = message.usage
    assert usage.cache_read_input_tokens > 0 and usage.cache_creation_input_tokens == 0
    assert usage.input_tokens + usage.cache_read_input_tokens == num_prompt
    assert usage.output_tokens == 12
    again = chat(server, [{"role": "system", "content": system},
                          {"role": "user", "content": question}], max_tokens=12)  # fmt: skip
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (
        usage.cache_read_input_tokens
    )

    # the system prompt as text blocks says the same
    blocks = [{"type": "text", "text": system}]
    assert client.messages.create(system=blocks, **kwargs).content[0].text == text

    with client.messages.stream(system=system, **kwargs) as stream:
        events = list(stream)
        streamed = stream.get_final_message()
    kinds = [e.type for e in events if not e.type.startswith(("text", "input_json"))]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    started = events[0].message.usage  # known when the stream starts, as Anthropic sends it
    assert started.input_tokens + started.cache_read_input_tokens == num_prompt
    assert streamed.content[0].text == text and streamed.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == 12
    assert streamed.usage.cache_read_input_tokens == usage.cache_read_input_tokens


def test_a_fresh_prompt_has_no_cache_read_and_a_repeated_one_does(client):
    kwargs = dict(model="tiny", max_tokens=4, extra_body=GREEDY,
                  messages=[{"role": "user", "content": fresh("Tell me about caching.")}])  # fmt: skip
    first = client.messages.create(**kwargs).usage
    second = client.messages.create(**kwargs).usage
    assert first.cache_read_input_tokens == 0
    assert second.cache_read_input_tokens > 0
    assert second.input_tokens + second.cache_read_input_tokens == first.input_tokens
    assert second.cache_read_input_tokens % 8 == 0  # whole blocks of --block-size 8


def _new_pair(text: str) -> int | None:
    """Where the first two characters from the third on that are not blank and not seen
    before start (the greedy text goes on past them), if any."""
    return next((i for i in range(3, len(text) - 1) if text[i : i + 2].strip()
                 and text.index(text[i : i + 2]) == i), None)  # fmt: skip


def test_a_stop_sequence_ends_the_message_and_is_named(server, client):
    # the tiny random model's greedy text after a fresh prefix is sometimes too short or
    # too repetitive to hold such a pair: the first of a few prefixes whose text does
    for _ in range(8):
        question = fresh("Count: 0123456789")
        text = chat(server, [{"role": "user", "content": question}], max_tokens=16)
        text = text["choices"][0]["message"]["content"]
        at = _new_pair(text)
        if at is not None:
            break
    assert at is not None, "no greedy text with two new characters to stop at"
    stop = text[at : at + 2]
    kwargs = dict(model="tiny", max_tokens=16, stop_sequences=[stop], extra_body=GREEDY,
                  messages=[{"role": "user", "content": question}])  # fmt: skip
    message = client.messages.create(**kwargs)
    assert message.content[0].text == text[:at]
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == text[:at]
    assert (streamed.stop_reason, streamed.stop_sequence) == ("stop_sequence", stop)


def test_a_forced_tool_gives_valid_input_and_its_result_goes_back(server, client):
    question = "What is the weather like in Paris today?"
    kwargs = dict(model="tiny", max_tokens=100, tools=[WEATHER], extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"},
                  messages=[{"role": "user", "content": question}])  # fmt: skip
    message = client.messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    (block,) = message.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_")
    assert isinstance(block.input, dict)
    jsonschema.validate(block.input, WEATHER["input_schema"])

    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", "get_weather", block.input)
    ]

    # the tool's result, sent back: the answer is the chat endpoint's for the same turns
    turns = [
        {"role": "user", "content": question},
        {"role": "assistant", "content": message.content},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": block.id, "content": "22 C, sunny"}]},
    ]  # fmt: skip
    answer = client.messages.create(model="tiny", max_tokens=10, tools=[WEATHER],
                                    messages=turns, extra_body=GREEDY)  # fmt: skip
    call = {"id": block.id, "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(block.input)}}  # fmt: skip
    reference = chat(server, [
        {"role": "user", "content": question},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": block.id, "content": "22 C, sunny"},
    ], max_tokens=10, tools=[AS_CHAT_TOOL])  # fmt: skip
    text = "".join(b.text for b in answer.content if b.type == "text")
    assert text == reference["choices"][0]["message"]["content"]
    assert (
        answer.usage.input_tokens + answer.usage.cache_read_input_tokens
        == (reference["usage"]["prompt_tokens"])
    )


def test_a_final_assistant_message_is_a_prefill_the_answer_goes_on_from(server, client):
    """Anthropic's prefill: the answer continues the final assistant text (the chat path's
    continue_final_message), and holds only what comes after it."""
    question = fresh("The quick brown fox jumps over the lazy dog, and then?")
    turns = [{"role": "user", "content": question}, {"role": "assistant", "content": "The fox"}]
    reference = chat(server, turns, max_tokens=10, continue_final_message=True,
                     add_generation_prompt=False)  # fmt: skip
    message = client.messages.create(model="tiny", max_tokens=10, messages=turns,
                                      extra_body=GREEDY)  # fmt: skip
    assert message.content[0].text == reference["choices"][0]["message"]["content"]
    assert (
        message.usage.input_tokens + message.usage.cache_read_input_tokens
        == (reference["usage"]["prompt_tokens"])
    )
    blocks = [{"type": "text", "text": "The "}, {"type": "text", "text": "fox"}]
    split = client.messages.create(model="tiny", max_tokens=10, extra_body=GREEDY,
                                   messages=[turns[0], {"role": "assistant", "content": blocks}])  # fmt: skip
    assert split.content[0].text == message.content[0].text
    with client.messages.stream(model="tiny", max_tokens=10, messages=turns,
                                extra_body=GREEDY) as stream:  # fmt: skip
        assert stream.get_final_text() == message.content[0].text


@pytest.mark.parametrize(
    "changes, status, words",
    [
        ({"max_tokens": None}, 400, "max_tokens: Field required"),
        ({"messages": [{"role": "system", "content": "hi"}]}, 400, "messages.0.role"),
        ({"messages": [{"role": "user", "content": [
            {"type": "text", "text": "What is this?"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}]}]},
         400, "messages.0.content.1: image content is not supported"),
        ({"top_logprobs": 2}, 400, "top_logprobs"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, 400, "thinking"),
        ({"output_config": {"effort": "low"}}, 400, "output_config"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant",
                                                          "content": "The answer is "}]},
         400, "messages.1: final assistant content cannot end with trailing whitespace"),
        ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}]},
         400, "messages.1: a final assistant message (prefill) must be text only"),
        ({"temperature": 1.5}, 400, "temperature"),
        ({"model": "claude-nonexistent"}, 404, "claude-nonexistent"),
    ],
)  # fmt: skip
def test_errors_are_in_anthropics_shape(server, changes, status, words):
    body = {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    body = {k: v for k, v in {**body, **changes}.items() if v is not None}
    response = httpx.post(f"{server.url}/v1/messages", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    kind = "not_found_error" if status == 404 else "invalid_request_error"
    assert error == {"type": "error", "error": {"type": kind, "message": error["error"]["message"]}}
    assert words in error["error"]["message"]


def test_the_sdk_raises_its_own_errors(client):
    ask = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="nope", max_tokens=4, messages=ask)
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="tiny", max_tokens=4, messages=ask, stop_sequences=[""])
    assert "stop_sequences" in caught.value.body["error"]["message"]


def test_a_wrong_method_is_an_anthropic_error_too(server):
    response = httpx.get(f"{server.url}/v1/messages")
    assert response.status_code == 405 and "POST" in response.headers["allow"]
    assert response.json() == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "Method Not Allowed"},
    }


def test_a_stream_that_fails_ends_with_an_error_event():
    """The chat stream's error event (the engine died mid-way) becomes Anthropic's."""
    writer = _EventWriter("tiny", _EngineView())
    role = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                   "content": ""}}]}  # fmt: skip
    piece = {"id": "chatcmpl-1", "choices": [{"index": 0, "delta": {"content": "Hel"}}]}
    dead = {"error": {"message": "the engine died", "type": "service_unavailable"}}
    frames = [f for chunk in (role, piece, dead) for f in writer.write(chunk)]
    events = [frame.decode().split("\n")[:2] for frame in frames]
    assert [e[0] for e in events] == ["event: message_start", "event: content_block_start",
                                      "event: content_block_delta", "event: error"]  # fmt: skip
    assert json.loads(events[-1][1].removeprefix("data: ")) == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "the engine died"},
    }
    assert writer.done


def test_x_api_key_is_a_key():
    access = Access(api_keys=("sesame",))
    for headers in ({"x-api-key": "sesame"}, {"authorization": "Bearer sesame"}):
        assert access.admit("/v1/messages", Headers(headers)) == (None, None)
    refusal, _ = access.admit("/v1/messages", Headers({"x-api-key": "wrong"}))
    assert refusal.status_code == 401
    assert json.loads(refusal.body)["error"]["type"] == "authentication_error"
    assert access.admit("/v1/chat/completions", Headers({"x-api-key": "wrong"}))[0] is not None


def test_through_the_router_with_an_api_key(tiny_checkpoint, tmp_path: Path, monkeypatch):
    """One cluster (`ember up --mixed 1`) whose router checks the key: the SDK's
    `Authorization: Bearer` and `x-api-key` (as other Anthropic clients send it) both pass."""
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    key = "sk-ember-test-messages"
    (tmp_path / "key").write_text(key + "\n")
    model = str(tiny_checkpoint("llama"))
    up = Up(model, "--mixed", "1", "--api-key-file", str(tmp_path / "key"),
            "--max-model-len", "1024", headers={"x-api-key": key})  # fmt: skip
    try:
        ask = [{"role": "user", "content": "Say hi"}]
        bearer = anthropic.Anthropic(base_url=up.url, api_key=key, max_retries=0)
        message = bearer.messages.create(model=model, max_tokens=6, messages=ask,
                                         metadata={"user_id": "user-7"}, extra_body=GREEDY)  # fmt: skip
        assert message.content[0].type == "text" and message.usage.output_tokens == 6
        assert up.load()["decisions"].get("affinity") == 1  # the session from user_id

        x_api_key = anthropic.Anthropic(base_url=up.url, api_key=None, max_retries=0,
                                        default_headers={"x-api-key": key})  # fmt: skip
        with x_api_key.messages.stream(model=model, max_tokens=6, messages=ask,
                                       extra_body=GREEDY) as stream:  # fmt: skip
            streamed = stream.get_final_message()
        assert streamed.content[0].text == message.content[0].text
        assert streamed.usage.output_tokens == 6
        assert up.load()["decisions"].get("affinity") == 1  # no session: placed by load

        with bearer.messages.stream(model=model, max_tokens=100, messages=ask, tools=[WEATHER],
                                    tool_choice={"type": "tool", "name": "get_weather"},
                                    extra_body=GREEDY) as stream:  # fmt: skip
            called = stream.get_final_message()
        (use,) = [block for block in called.content if block.type == "tool_use"]
        assert use.name == "get_weather" and set(use.input) == {"city", "unit"}
        assert called.stop_reason == "tool_use"

        stranger = anthropic.Anthropic(base_url=up.url, api_key=None, max_retries=0,
                                       default_headers={"x-api-key": "wrong"})  # fmt: skip
        with pytest.raises(anthropic.AuthenticationError) as caught:
            stranger.messages.create(model=model, max_tokens=4, messages=ask)
        assert caught.value.body == {
            "type": "error",
            "error": {"type": "authentication_error", "message": "missing or invalid API key"},
        }
        response = httpx.post(f"{up.url}/v1/messages", content=b"{", headers={"x-api-key": key})
        assert response.status_code == 400
        assert response.json()["error"]["type"] == "invalid_request_error"
    finally:
        up.stop()

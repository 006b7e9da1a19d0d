"""Tool calls and structured outputs: requests checked on their own, then SmolLM2 behind
`ember serve` driven with the openai SDK (a full tool-call round trip; JSON that always
validates). The tool-call parsers have their own tests (test_parsers.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import openai
import pytest

from ember.loader.default_models import resolve_model
from ember.server.chat import tool_plan
from ember.server.protocol import ChatCompletionRequest
from server_utils import EmberServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 24},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 24}},
            "required": ["zone"],
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "languages": {
            "type": "array",
            "items": {"enum": ["en", "fr", "de", "ja"]},
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}


# -- requests, without a model ----------------------------------------------------------


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"tool_choice": "required"}, "tool_choice needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "not in tools",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "schema is required",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot be combined",
        ),  # fmt: skip
    ],
)
def test_inconsistent_tool_requests_are_refused(changes, message):
    request = ChatCompletionRequest(messages=ASK, **changes)
    with pytest.raises(ValueError, match=message):
        tool_plan(request)


# -- SmolLM2 behind a real server --------------------------------------------------------


@pytest.fixture(scope="module")
def smol():
    srv = EmberServer(
        str(resolve_model(None)), "--served-model-name", "smollm2-135m",
        "--kv-cache-memory", "256M", "--max-model-len", "2048",
    )  # fmt: skip
    yield srv
    assert srv.stop() == 0


@pytest.fixture(scope="module")
def client(smol):
    return openai.OpenAI(base_url=f"{smol.url}/v1", api_key="unused", max_retries=0)


def chat(client, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": 80} | kwargs
    return client.chat.completions.create(model="smollm2-135m", **kwargs)


def test_tool_call_round_trip(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice=named)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])

    result = {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}
    history = [*ASK, choice.message.model_dump(exclude_none=True), result]
    second = chat(client, messages=history, tools=[WEATHER, TIME])
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # the tool definitions and the first turn are a cached prefix of the second turn
    assert second.usage.prompt_tokens_details.cached_tokens >= 16


def test_required_tool_choice_always_yields_valid_calls(client):
    result = chat(client, messages=ASK, tools=[WEATHER, TIME], tool_choice="required")
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_streamed_tool_call_deltas_add_up_to_the_call(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = chat(client, messages=ASK, tools=[WEATHER], tool_choice=named).choices[0]
    stream = chat(client, messages=ASK, tools=[WEATHER], tool_choice=named, stream=True)
    name, arguments, ids, finish = "", "", set(), None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for call in delta.tool_calls or []:
            assert call.index == 0
            ids.add(call.id) if call.id else None
            name += call.function.name or ""
            arguments += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert name == "get_weather" and len(ids) == 1 and finish == "tool_calls"
    assert arguments == whole.message.tool_calls[0].function.arguments


@pytest.mark.parametrize("seed", [None, 1, 2])
def test_json_schema_outputs_validate(client, seed):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    sampled = {} if seed is None else {"temperature": 1.0, "seed": seed}
    result = client.chat.completions.create(
        model="smollm2-135m",
        messages=[{"role": "user", "content": "Invent a person. Answer in JSON."}],
        response_format=fmt,
        max_tokens=120,
        **({"temperature": 0} | sampled),
    )
    choice = result.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_outputs_parse_streamed(client):
    stream = chat(
        client,
        messages=[{"role": "user", "content": "Return a JSON object with a cat's name and age."}],
        response_format={"type": "json_object"},
        max_tokens=200,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_completions_take_response_format_as_vllm_does(client):
    """vLLM's response_format on /v1/completions: the same grammar as chat's, for each of
    n choices and streamed; "text" changes nothing; a bad schema is a 400 naming it."""
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}

    def complete(**kwargs):
        kwargs = {"prompt": "A person, as JSON: ", "max_tokens": 120, "temperature": 0} | kwargs
        return client.completions.create(model="smollm2-135m", **kwargs)

    sampled = complete(n=2, temperature=1.0, seed=3, extra_body={"response_format": fmt})
    for choice in sampled.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.text), PERSON)
    chunks = [c.choices[0] for c in complete(stream=True, extra_body={"response_format": fmt})]
    assert chunks[-1].finish_reason == "stop"
    jsonschema.validate(json.loads("".join(c.text for c in chunks)), PERSON)
    text = complete(max_tokens=20, extra_body={"response_format": {"type": "text"}})
    assert text.choices[0].text == complete(max_tokens=20).choices[0].text
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as info:
        complete(extra_body={"response_format": bad})
    assert info.value.body["param"] == "response_format"


def test_bad_schema_is_a_400(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages=ASK, response_format=fmt)
    assert info.value.body["param"] == "response_format"


def test_ember_chat_keeps_history(smol):
    script = "My name is Ada.\nWhat is my name?\n/exit\n"
    result = subprocess.run(
        [sys.executable, "-m", "ember.cli", "chat", "--url", smol.url, "--temperature", "0",
         "--max-tokens", "30", "--system", "You are brief."],
        input=script, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "smollm2-135m" in result.stderr  # the model it found on the server
    assert result.stdout.count("\n") >= 2  # two replies
    turns = [line for line in result.stderr.splitlines() if line.startswith("[usage]")]
    first, second = (dict(kv.split("=") for kv in t.split()[1:]) for t in turns)
    # the second turn resends the first (user + reply), which the prefix cache already holds
    assert int(second["prompt"]) > int(first["prompt"]) + int(first["completion"])
    assert int(second["cached"]) >= int(first["prompt"]) // 16 * 16 > 0

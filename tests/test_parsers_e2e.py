"""Tool calls and reasoning end to end: a tiny Llama whose weights make greedy decoding
write a chosen script (reasoning, then a tool call in a family's format), served by
`ember serve` with its parsers chosen from the chat template or by flag, read with the
openai SDK, streaming and not."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest
import torch

from conftest import build_tokenizer
from server_utils import WORKER_ARGS, EmberServer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
TURNS = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
)
# Hermes calls, thinking the model opens itself: the parsers are read from the template
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nThink in <think></think>, then call functions as "
    '<tool_call>{"name": ..., "arguments": ...}</tool_call>:\n{% for t in tools %}'
    "{{ t | tojson }}\n{% endfor %}<|im_end|>\n{% endif %}" + TURNS + "{% endif %}"
)
HERMES_SCRIPT = [
    "<think>", "The user ", "wants Paris.", "</th", "ink>", "Let me ", "check.", "<tool_",
    "call>", '{"name": ', '"get_weather", ', '"arguments": ', '{"city": ', '"Paris"}}',
    "</tool_call>",
]  # fmt: skip
# Kimi K2's special tokens, thinking opened by the template: the parsers are named by flag
KIMI_TEMPLATE = TURNS + "<think>{% endif %}"
KIMI_SPECIAL = [
    "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
    "<|tool_call_end|>", "<|tool_calls_section_end|>",
]  # fmt: skip
KIMI_SCRIPT = [
    "Need ", "the weather", ".\n", "</think>", "\n\nOn it.", KIMI_SPECIAL[0], KIMI_SPECIAL[1],
    "functions.get_weather:0", KIMI_SPECIAL[2], '{"city": ', '"Paris"}', KIMI_SPECIAL[3],
    KIMI_SPECIAL[4],
]  # fmt: skip


def scripted_checkpoint(path: Path, template: str, script: list[str], special=()) -> Path:
    """A one-layer Llama that, after the chat prompt, greedily writes `script` (each
    piece one token) and then EOS: attention and MLP outputs are zeroed, so each
    position's hidden state is its token's embedding, and the LM head maps the embedding
    of each token of the chain to the next."""
    from tokenizers import AddedToken
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer(path)
    tokenizer.chat_template = template
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in script if p not in special])
    tokenizer.add_tokens([AddedToken(p, special=True, normalized=False) for p in special])
    tokenizer.save_pretrained(path)
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    chain = [
        tokenizer.encode(prompt, add_special_tokens=False)[-1],
        *tokenizer.convert_tokens_to_ids(script),
        tokenizer.eos_token_id,
    ]
    assert len(set(chain)) == len(chain)  # each token has one successor
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        for dim, (token, successor) in enumerate(zip(chain[:-1], chain[1:], strict=True)):
            model.model.embed_tokens.weight[token, dim] = 1.0
            model.lm_head.weight[successor, dim] = 1.0
    model.save_pretrained(path)
    return path


def serve(path: Path, *flags: str) -> tuple[EmberServer, openai.OpenAI]:
    server = EmberServer(str(path), "--served-model-name", "tiny", *WORKER_ARGS, *flags)
    return server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    path = scripted_checkpoint(tmp_path_factory.mktemp("hermes"), HERMES_TEMPLATE, HERMES_SCRIPT)
    server, client = serve(path)
    yield client
    assert server.stop() == 0


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi")
    scripted_checkpoint(path, KIMI_TEMPLATE, KIMI_SCRIPT, special=KIMI_SPECIAL)
    server, client = serve(path, "--tool-call-parser", "kimi_k2", "--reasoning-parser", "kimi_k2")
    yield client
    assert server.stop() == 0


def chat(client, **kwargs):
    return client.chat.completions.create(
        model="tiny", messages=ASK, temperature=0, max_tokens=40, **kwargs
    )


def streamed(client, **kwargs) -> dict:
    """The streamed deltas added up, with how many pieces each part came in."""
    out = {"reasoning": "", "content": "", "calls": {}, "finish": None, "pieces": {}}
    for chunk in chat(client, stream=True, **kwargs):
        choice = chunk.choices[0]
        delta = choice.delta
        out["finish"] = choice.finish_reason or out["finish"]
        for part, text in (("reasoning", getattr(delta, "reasoning_content", None)),
                           ("content", delta.content)):  # fmt: skip
            if text:
                out[part] += text
                out["pieces"][part] = out["pieces"].get(part, 0) + 1
        for call in delta.tool_calls or []:
            entry = out["calls"].setdefault(call.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = entry["id"] or call.id
            entry["name"] += call.function.name or ""
            entry["arguments"] += call.function.arguments or ""
            out["pieces"]["arguments"] = out["pieces"].get("arguments", 0) + 1
    return out


@pytest.mark.parametrize(
    "fixture, reasoning, content, call_id",
    [
        ("hermes", "The user wants Paris.", "Let me check.", None),
        ("kimi", "Need the weather.", "On it.", "functions.get_weather:0"),
    ],
)
def test_reasoning_and_tool_calls_come_out_of_the_text(
    request, fixture, reasoning, content, call_id
):
    client = request.getfixturevalue(fixture)
    choice = chat(client, tools=[WEATHER]).choices[0]
    assert choice.message.reasoning_content == reasoning
    assert choice.message.content == content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert call.id == call_id if call_id else call.id.startswith("call_")
    assert choice.finish_reason == "tool_calls"

    stream = streamed(client, tools=[WEATHER])
    assert (stream["reasoning"], stream["content"]) == (reasoning, content)
    assert stream["calls"] == {0: {"id": stream["calls"][0]["id"], "name": "get_weather",
                                   "arguments": call.function.arguments}}  # fmt: skip
    assert stream["finish"] == "tool_calls"
    # streamed as generated: the reasoning and the arguments arrive in several pieces
    assert stream["pieces"]["reasoning"] > 1 and stream["pieces"]["arguments"] > 1


def test_without_tools_the_reasoning_is_still_separated(hermes):
    message = chat(hermes).choices[0].message
    assert message.reasoning_content == "The user wants Paris."
    assert message.tool_calls is None
    assert message.content.startswith("Let me check.<tool_call>{")


def test_include_reasoning_false_drops_the_reasoning_and_keeps_the_rest(hermes):
    """vLLM's include_reasoning: the reasoning is still parsed out of the answer, and
    not returned (whole or streamed)."""
    kept = chat(hermes, tools=[WEATHER]).choices[0]
    dropped = chat(hermes, tools=[WEATHER], extra_body={"include_reasoning": False}).choices[0]
    assert kept.message.reasoning_content == "The user wants Paris."
    assert getattr(dropped.message, "reasoning_content", None) is None
    assert dropped.message.content == kept.message.content == "Let me check."
    assert dropped.message.tool_calls[0].function == kept.message.tool_calls[0].function
    stream = streamed(hermes, tools=[WEATHER], extra_body={"include_reasoning": False})
    assert (stream["reasoning"], stream["content"]) == ("", "Let me check.")
    assert stream["calls"][0]["name"] == "get_weather"


def test_unknown_parser_names_fail_at_start_with_the_known_ones():
    for command in ("serve", "up"):
        result = subprocess.run(
            [sys.executable, "-m", "ember.cli", command, "--tool-call-parser", "hermes2"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert result.returncode == 2
        assert "known: auto, deepseek_v3, hermes, kimi_k2, llama3, mistral" in result.stderr


def test_ember_up_passes_the_parsers_to_its_workers():
    from ember.cli import build_parser
    from ember.router.up import server_flags

    parser = build_parser()
    up = parser.parse_args(["up", "--tool-call-parser", "mistral", "--reasoning-parser", "none"])
    worker, _ = server_flags(up)
    serve_args = parser.parse_args(["serve", *worker])
    assert (serve_args.tool_call_parser, serve_args.reasoning_parser) == ("mistral", "none")


def test_the_responses_api_returns_reasoning_items(hermes):
    """The same script through /v1/responses: a reasoning item, the message, the call;
    streamed as reasoning_text, output_text and function-call-argument events."""
    tool = {"type": "function", **WEATHER["function"]}
    kwargs = dict(model="tiny", input=ASK[0]["content"], tools=[tool], temperature=0,
                  max_output_tokens=40)  # fmt: skip
    response = hermes.responses.create(**kwargs)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message", "function_call"]
    assert response.output[0].content[0].text == "The user wants Paris."
    assert response.output_text == "Let me check."
    assert json.loads(response.output[2].arguments) == {"city": "Paris"}

    events = list(hermes.responses.create(stream=True, **kwargs))
    joined = {kind: "".join(e.delta for e in events if e.type == kind)
              for kind in ("response.reasoning_text.delta", "response.output_text.delta",
                           "response.function_call_arguments.delta")}  # fmt: skip
    assert joined == {
        "response.reasoning_text.delta": "The user wants Paris.",
        "response.output_text.delta": "Let me check.",
        "response.function_call_arguments.delta": response.output[2].arguments,
    }
    final = events[-1].response
    assert [item.type for item in final.output] == kinds
    assert final.output[0].content[0].text == "The user wants Paris."


def test_the_messages_api_returns_thinking_blocks(hermes):
    """The same script through /v1/messages (anthropic SDK): thinking, text and tool_use
    blocks, in that order, streamed as thinking, text and input_json deltas."""
    import anthropic

    client = anthropic.Anthropic(base_url=str(hermes.base_url).removesuffix("/v1/"),
                                 api_key="unused", max_retries=0)  # fmt: skip
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    kwargs = dict(model="tiny", max_tokens=40, messages=ASK, tools=[tool],
                  extra_body={"temperature": 0})  # fmt: skip
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        with pytest.raises(anthropic.BadRequestError, match="thinking"):  # not ignored
            client.messages.create(thinking=thinking, **kwargs)
    message = client.messages.create(**kwargs)
    assert [block.type for block in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[0].thinking == "The user wants Paris."
    assert message.content[1].text == "Let me check."
    assert message.content[2].input == {"city": "Paris"}
    assert message.stop_reason == "tool_use"

    deltas: dict[str, str] = {}
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                kind = event.delta.type
                piece = getattr(
                    event.delta,
                    {"thinking_delta": "thinking", "text_delta": "text"}.get(kind, "partial_json"),
                )
                deltas[kind] = deltas.get(kind, "") + piece  # fmt: skip
    assert deltas["thinking_delta"] == "The user wants Paris."
    assert deltas["text_delta"] == "Let me check."
    assert json.loads(deltas["input_json_delta"]) == {"city": "Paris"}

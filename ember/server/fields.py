"""Every request field of /v1/chat/completions and /v1/completions, and what ember does
with it: the audit, as one table.

A field is `honoured` (it does what OpenAI's API reference, or vLLM's for its
extensions, says), `irrelevant` (accepted and ignored: it cannot change the output, as
`user` or `store`), or `refused` (a 400 naming it when set to anything but null or one
of its `no_ops`, values that change nothing). The request models (`protocol.py`) declare
exactly these fields and refuse from this table; the README's table is
`markdown_table()` (a test checks both, and walks every refused and irrelevant field
against a real server). Fields that neither API defines are ignored, as vLLM does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

Support = Literal["honoured", "irrelevant", "refused"]
Api = Literal["chat", "completions"]
BOTH: tuple[Api, ...] = ("chat", "completions")
CHAT: tuple[Api, ...] = ("chat",)
COMPLETIONS: tuple[Api, ...] = ("completions",)


@dataclass(frozen=True)
class RequestField:
    name: str  # a nested field as `parent.child`
    support: Support
    apis: tuple[Api, ...]
    note: str = ""
    example: Any = None  # refused: a value refused; irrelevant: a value accepted
    no_ops: tuple = ()  # refused: values accepted because they change nothing


def _honoured(name: str, apis: tuple[Api, ...], note: str = "") -> RequestField:
    return RequestField(name, "honoured", apis, note)


def _irrelevant(name: str, apis: tuple[Api, ...], example: Any, note: str = "") -> RequestField:
    return RequestField(name, "irrelevant", apis, note, example)


def _refused(name: str, apis: tuple[Api, ...], example: Any, no_ops: tuple = (), note: str = ""):
    return RequestField(name, "refused", apis, note, example, no_ops)


FIELDS: tuple[RequestField, ...] = (
    # OpenAI's fields
    _honoured("model", BOTH, "the served name (404 otherwise)"),
    _honoured("messages", CHAT, "through the model's chat template"),
    _honoured("prompt", COMPLETIONS, "text, texts, token ids or lists of them"),
    _honoured("max_tokens", BOTH, "chat default: the rest of the context; completions: 16"),
    _honoured("max_completion_tokens", CHAT, "wins over max_tokens"),
    _honoured("n", BOTH, "1-128"),
    _honoured("temperature", BOTH, "0-2; 0 is greedy"),
    _honoured("top_p", BOTH, "(0, 1]"),
    _honoured(
        "seed",
        BOTH,
        "any int64; the n choices get seed, seed + 1, ...; the tokens depend on the seed "
        "and the prompt only (not the batch, speculative drafts, a preemption or the "
        "worker that decodes)",
    ),
    _honoured("stop", BOTH, "up to 64 strings of up to 1024 characters"),
    _honoured("presence_penalty", BOTH, "-2 to 2"),
    _honoured("frequency_penalty", BOTH, "-2 to 2"),
    _honoured("logit_bias", BOTH, "token id -> [-100, 100], before penalties and sampling"),
    _honoured("logprobs", BOTH, "chat: true/false; completions: 0-20 alternatives"),
    _honoured("top_logprobs", CHAT, "0-20, with logprobs"),
    _honoured("echo", COMPLETIONS, "the prompt first; with logprobs its tokens' (first null)"),
    _honoured("stream", BOTH, "server-sent events"),
    _honoured("stream_options.include_usage", BOTH, "a last chunk with the usage"),
    _honoured("tools", CHAT, "functions"),
    _honoured("tool_choice", CHAT, "none, auto, required or a named function"),
    _honoured("parallel_tool_calls", CHAT, "false: at most one call"),
    _honoured("response_format", BOTH, "text, json_object, json_schema (completions: vLLM's)"),
    _irrelevant("user", BOTH, "user-1"),
    _irrelevant("metadata", CHAT, {"tag": "x"}, "stored completions are not kept"),
    _irrelevant("store", CHAT, True, "stored completions are not kept"),
    _irrelevant("service_tier", CHAT, "auto"),
    _irrelevant("safety_identifier", CHAT, "user-1"),
    _irrelevant("prompt_cache_key", CHAT, "k", "prefix caching is automatic"),
    _irrelevant("prediction", CHAT, {"type": "content", "content": "x"}, "a latency hint"),
    _irrelevant("stream_options.include_obfuscation", BOTH, True, "no obfuscation padding"),
    _refused("best_of", COMPLETIONS, 2, note="unless equal to n"),
    _refused("suffix", COMPLETIONS, "end", ("",)),
    _refused("functions", CHAT, [{"name": "f"}], ([],), "use tools"),
    _refused("function_call", CHAT, "auto", ("none",), "use tool_choice"),
    _refused("audio", CHAT, {"voice": "alloy", "format": "wav"}),
    _refused("modalities", CHAT, ["text", "audio"], (["text"],)),
    _refused("web_search_options", CHAT, {}),
    _refused("reasoning_effort", CHAT, "high"),
    _refused("verbosity", CHAT, "low"),
    # vLLM's extensions, and ember's own
    _honoured("top_k", BOTH, "vLLM's; -1 or 0 (off) up to the vocabulary size"),
    _honoured("min_p", BOTH, "vLLM's; 0-1"),
    _honoured("repetition_penalty", BOTH, "vLLM's; (0, 2]"),
    _honoured("min_tokens", BOTH, "vLLM's; EOS, stop ids and stop strings wait for it"),
    _honoured("stop_token_ids", BOTH, "vLLM's"),
    _honoured("ignore_eos", BOTH, "vLLM's"),
    _honoured("skip_special_tokens", BOTH, "vLLM's"),
    _honoured("return_tokens_as_token_ids", BOTH, "vLLM's; logprobs name each token `token_id:N`"),
    _honoured("stream_options.continuous_usage_stats", BOTH, "vLLM's; usage in every chunk"),
    _honoured("add_generation_prompt", CHAT, "vLLM's"),
    _honoured("continue_final_message", CHAT, "vLLM's; the last (assistant) message goes on"),
    _honoured(
        "chat_template_kwargs",
        CHAT,
        "vLLM's; the template's own variables (as enable_thinking), not apply_chat_template's",
    ),
    _honoured("add_special_tokens", BOTH, "vLLM's; chat default false, completions true"),
    _honoured("include_reasoning", CHAT, "vLLM's; false drops reasoning_content"),
    _honoured(
        "truncate_prompt_tokens",
        BOTH,
        "vLLM's; keeps that many prompt tokens (-1: all that leave room for max_tokens)",
    ),
    _honoured(
        "truncation_side", BOTH, "vLLM's; left (the start goes) or right; default: the tokenizer's"
    ),
    _honoured("cache_salt", BOTH, "vLLM's; keeps a tenant's prefix cache apart"),
    _honoured("kv_retention", BOTH, "ember's; 'session' keeps the KV as a session's"),
    _honoured("kv_transfer_params", BOTH, "ember's router sets it; clients cannot"),
    _honoured("resume_params", BOTH, "ember's router sets it (a moved stream); clients cannot"),
    _honoured("prompt_logprobs", COMPLETIONS, "vLLM's; computes the whole prompt (no cache)"),
    _refused("prompt_logprobs", CHAT, 1),
    _refused("use_beam_search", BOTH, True, (False,)),
    _refused("include_stop_str_in_output", BOTH, True, (False,)),
    _refused("bad_words", BOTH, ["x"], ([],)),
    _refused("allowed_token_ids", BOTH, [1]),
    _refused("guided_json", BOTH, {"type": "object"}, note="use response_format"),
    _refused("guided_regex", BOTH, "a+"),
    _refused("guided_choice", BOTH, ["a", "b"]),
    _refused("guided_grammar", BOTH, "root ::= 'a'"),
    _refused("structured_outputs", BOTH, {"json": {"type": "object"}}, note="use response_format"),
    _refused("thinking_token_budget", BOTH, 64),
    _refused("echo", CHAT, True, (False,)),
    _refused("documents", CHAT, [{"title": "a", "text": "b"}], ([],)),
    _refused("chat_template", CHAT, "{{ messages }}", note="the model's own template only"),
    _refused("spaces_between_special_tokens", BOTH, False, (True,)),
    _refused("length_penalty", BOTH, 2.0, (1.0,), "beam search's"),
    _refused("logprob_token_ids", BOTH, [1]),
    _refused("return_token_ids", BOTH, True, (False,)),
    _refused("return_token_offsets", BOTH, True, (False,)),
    _refused("return_prompt_text", CHAT, True, (False,)),
    _refused("prompt_embeds", COMPLETIONS, "AAAA"),
    _refused("priority", BOTH, 1, (0,)),
    _refused("request_id", BOTH, "r-1", note="ember names its responses"),
    _refused("session_id", BOTH, "s-1", note="use the x-session-affinity header"),
    _refused("stream_interval", BOTH, 4, (1,)),
    _refused("repetition_detection", BOTH, {"max_pattern_size": 4}),
    _refused("watermarking", BOTH, {"enabled": True}),
    _refused("vllm_xargs", BOTH, {"k": 1}, ({},)),
    _refused("ec_transfer_params", BOTH, {}),
    _refused("routed_experts_prompt_start", BOTH, 1, (0,)),
    _irrelevant("mm_processor_kwargs", CHAT, {}, "no media inputs"),
    _irrelevant("media_io_kwargs", CHAT, {}, "no media inputs"),
    _irrelevant("mm_payload", BOTH, "tensors", "no media inputs"),
    _irrelevant("return_mm_kwargs", BOTH, True, "no media inputs"),
)


def fields_of(api: Api, support: Support | None = None) -> list[RequestField]:
    return [f for f in FIELDS if api in f.apis and support in (None, f.support)]


def refused(api: Api) -> dict[str, tuple]:
    """Refused top-level field -> the values that change nothing (null aside)."""
    return {f.name: f.no_ops for f in fields_of(api, "refused")}


def markdown_table() -> str:
    """The README's table of fields."""
    lines = ["| field | chat | completions | ember |", "|---|---|---|---|"]
    for f in FIELDS:
        apis = ["yes" if api in f.apis else "" for api in BOTH]
        note = f"{f.support}: {f.note}" if f.note else f.support
        lines.append(f"| `{f.name}` | {apis[0]} | {apis[1]} | {note} |")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m ember.server.fields > the README's table
    print(markdown_table())

"""Chat requests into prompts, and tool calls out of the model's text.

Templates that know tools (they mention `tools`) get the tools and tool calls as they
are. For templates that do not (SmolLM2's, for one), ember describes the tools in the
system message in the Hermes style that most open models are trained on, writes earlier
tool calls as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` and wraps tool
results in `<tool_response>`; the `hermes` parser reads the same format back. Tool calls
(and reasoning) come out of the model's text through the served model's parsers
(`ember.server.parsers`).

How each `tool_choice` is served (`tool_plan`):
    none      no tools in the prompt, plain text
    auto      tools in the prompt; calls in the model's format become tool_calls
    required  output constrained to a JSON array of {"name", "arguments"} (>= 1 item)
    named     output constrained to that function's parameters: the output is its arguments
With `parallel_tool_calls: false` a required array holds one call and auto returns only
the first call it finds (`ToolPlan.max_calls`).
Constrained arguments and `response_format` json_schema outputs are compact JSON whose
objects are closed unless the schema sets `additionalProperties` (`prepare_schema`); a
`strict: true` schema must also follow OpenAI's strict rules, whatever the tool_choice.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass

from ember.engine.structured_output import (
    json_schema_grammar,
    prepare_schema,
    tool_calls_grammar,
)
from ember.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    ResponseFormat,
    Tool,
)

TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"

_TOOLS_PREAMBLE = (
    "You can call functions to help with the user's request. To call one, reply with a "
    "JSON object with the function's name and arguments inside <tool_call></tool_call> "
    'tags, e.g.\n<tool_call>\n{"name": "function_name", "arguments": {"arg": "value"}}\n'
    "</tool_call>\nThe available functions:\n<tools>\n"
)


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    function: str | None = None  # the named function
    grammar: str | None = None  # what the output must follow (required / named / JSON)
    max_calls: int | None = None  # parallel_tool_calls false: 1


def tool_plan(request: ChatCompletionRequest) -> ToolPlan:
    """Decides how tools and response_format shape this request; ValueError names the
    parameter that is wrong."""
    tools = request.tools or []
    choice = request.tool_choice or ("auto" if tools else "none")
    json_grammar = response_format_grammar(request.response_format)
    for index, tool in enumerate(tools):  # as OpenAI does, whatever the tool_choice
        if tool.function.strict:
            prepare_schema(_parameters(tool), _param(index), strict=True)
    if choice == "none":
        return ToolPlan("none", grammar=json_grammar)
    if not tools:
        raise ValueError("tool_choice needs tools")
    if json_grammar is not None and choice != "auto":
        raise ValueError("response_format cannot be combined with a forced tool_choice")
    max_calls = None if request.parallel_tool_calls else 1
    if choice == "auto":  # the model may answer in text: arguments are not constrained
        return ToolPlan("auto", grammar=json_grammar, max_calls=max_calls)
    if choice == "required":
        functions = [
            (t.function.name, prepare_schema(_parameters(t), _param(i)), _param(i))
            for i, t in enumerate(tools)
        ]
        grammar = tool_calls_grammar(functions, max_calls)
        return ToolPlan("required", grammar=grammar, max_calls=max_calls)
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.get("name")
    index = next((i for i, t in enumerate(tools) if t.function.name == name), None)
    if index is None:
        raise ValueError(f"tool_choice names function {name!r}, which is not in tools")
    grammar = json_schema_grammar(_parameters(tools[index]), _param(index))
    return ToolPlan("named", name, grammar)


def _parameters(tool: Tool) -> dict:
    """The schema of a function's arguments (none given: it takes an empty object)."""
    if tool.function.parameters is None:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    return tool.function.parameters


def _param(index: int) -> str:
    return f"tools.{index}.function.parameters"


def response_format_grammar(fmt: ResponseFormat | None) -> str | None:
    """The grammar a `response_format` (chat's, or completions' as vLLM takes it) holds
    the output to; None for text. ValueError names the parameter."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json_schema_grammar(None)
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise ValueError("response_format.json_schema.schema is required for json_schema")
    return json_schema_grammar(fmt.json_schema.schema_, strict=bool(fmt.json_schema.strict))


def render_prompt(tokenizer, request: ChatCompletionRequest, plan: ToolPlan) -> str:
    """The prompt's text, from the model's chat template (special tokens included: tokenize
    it without adding the tokenizer's own)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template; use /v1/completions")
    tools = request.tools if plan.mode != "none" else None
    native = tools is not None and "tools" in tokenizer.chat_template
    messages = [_message_dict(m, native) for m in request.messages]
    kwargs = _template_kwargs(tokenizer, request)
    if tools and native:
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in tools]
    elif tools:
        messages = _with_tools_in_system(messages, tools)
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except Exception as exc:  # jinja raises whatever the template raises
        raise ValueError(f"messages: the chat template failed: {exc}") from None


def _template_kwargs(tokenizer, request: ChatCompletionRequest) -> dict:
    """vLLM's `chat_template_kwargs`: variables the template reads (as Qwen3's
    `enable_thinking`); never apply_chat_template's own parameters (tools, documents,
    tokenize, ...), which are ember's to set."""
    if request.continue_final_message and request.add_generation_prompt:
        raise ValueError(
            "continue_final_message cannot be true with add_generation_prompt (set it false)"
        )
    given = request.chat_template_kwargs or {}
    reserved = {"messages", *inspect.signature(tokenizer.apply_chat_template).parameters}
    for name in given:
        if name in reserved:
            raise ValueError(f"chat_template_kwargs: {name!r} is not a template variable")
    return dict(given)


def _message_dict(message: ChatMessage, native_tools: bool) -> dict:
    content = _text(message.content)
    out: dict = {"role": "system" if message.role == "developer" else message.role}
    if message.tool_calls and native_tools:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    elif message.tool_calls:
        blocks = [
            _tool_call_text(c.function.name, c.function.arguments) for c in message.tool_calls
        ]
        content = "\n".join([content, *blocks] if content else blocks)
    if message.role == "tool" and not native_tools:
        content = f"<tool_response>\n{content}\n</tool_response>"
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    out["content"] = content
    return out


def _text(content: str | list[dict] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError("messages: only text content parts are supported")
        parts.append(part["text"])
    return "".join(parts)


def _tool_call_text(name: str, arguments: str | dict) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_OPEN}\n{body}\n{TOOL_CLOSE}"


def _with_tools_in_system(messages: list[dict], tools: list[Tool]) -> list[dict]:
    listing = "\n".join(json.dumps(t.model_dump(exclude_none=True)) for t in tools)
    text = _TOOLS_PREAMBLE + listing + "\n</tools>"
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{text}")
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def parse_required_calls(text: str) -> list[tuple[str, str]]:
    """(name, arguments) of the calls in the JSON array that tool_choice=required
    constrains the output to."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return []  # cut short by max_tokens
    return [(item["name"], json.dumps(item["arguments"], ensure_ascii=False)) for item in items]

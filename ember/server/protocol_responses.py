"""The OpenAI Responses API's request body (`POST /v1/responses`), and its translation into
the chat request ember runs (`to_chat`).

Input items map onto chat messages: a message item (role and text parts) onto a message,
consecutive `function_call` items onto one assistant message with those tool calls, a
`function_call_output` onto a `tool` message. `instructions` become the system message;
`text.format` becomes `response_format`; `max_output_tokens` becomes
`max_completion_tokens`. Fields that would change the output and that ember does not
implement (`_NOT_IMPLEMENTED`) are refused when set, never ignored; fields that change
nothing (metadata, user, service_tier, ...) are accepted.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from ember.sampling_params import BOUNDS
from ember.server.limits import MAX_MESSAGES, MAX_TOOLS

Text = Annotated[str, Field(min_length=1)]


def _bounded(name: str) -> Any:
    return Field(None, **BOUNDS[name].schema())


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Item):
    type: Literal["input_text", "output_text", "text"]
    text: str


class MessageItem(_Item):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionCallItem(_Item):
    type: Literal["function_call"]
    call_id: Text
    name: Text
    arguments: str


class FunctionCallOutputItem(_Item):
    type: Literal["function_call_output"]
    call_id: Text
    output: str | list[TextPart]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


InputItem = Annotated[
    MessageItem | FunctionCallItem | FunctionCallOutputItem, Field(union_mode="left_to_right")
]


class FunctionTool(_Item):
    type: Literal["function"]
    name: Text
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(_Item):
    type: Literal["function"]
    name: Text


class TextFormat(_Item):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Item):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # field: the values that change nothing (besides null); any other is refused
    _NOT_IMPLEMENTED: ClassVar[dict[str, tuple]] = {
        "reasoning": (),
        "include": ([],),
        "top_logprobs": (0,),
        "background": (False,),
        "truncation": ("disabled",),
        "max_tool_calls": (),
        "prompt": (),
        "conversation": (),
    }

    model: str | None = None
    input: Text | Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    max_output_tokens: int | None = _bounded("max_tokens")
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = _bounded("seed")  # ember's own, as on the chat endpoint
    resume_params: dict[str, Any] | None = None  # ember's router only (server/resume.py)
    # not implemented (refused unless null or harmless, see _NOT_IMPLEMENTED)
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    background: bool | None = None
    truncation: str | None = None
    max_tool_calls: int | None = None
    prompt: dict[str, Any] | None = None
    conversation: Any = None

    def check_supported(self) -> None:
        """ValueError naming the first field set to something ember does not implement."""
        for name, harmless in self._NOT_IMPLEMENTED.items():
            value = getattr(self, name)
            if value is not None and value not in harmless:
                raise ValueError(f"{name} is not supported by ember")

    def input_items(self) -> list[MessageItem | FunctionCallItem | FunctionCallOutputItem]:
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_fields(self) -> dict[str, Any]:
        """The chat request's fields other than its messages."""
        fields: dict[str, Any] = {
            "model": self.model,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_completion_tokens": self.max_output_tokens,
            "stream": self.stream,
            "stream_options": {"include_usage": True} if self.stream else None,
            "user": self.user,
            "seed": self.seed,
        }
        if self.tools:
            fields["tools"] = [_chat_tool(t) for t in self.tools]
        if isinstance(self.tool_choice, FunctionChoice):
            fields["tool_choice"] = {
                "type": "function",
                "function": {"name": self.tool_choice.name},
            }
        elif self.tool_choice is not None:
            fields["tool_choice"] = self.tool_choice
        if self.parallel_tool_calls is not None:
            fields["parallel_tool_calls"] = self.parallel_tool_calls
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            fields["response_format"] = _chat_format(fmt)
        return {k: v for k, v in fields.items() if v is not None}


def chat_messages(items: list) -> list[dict[str, Any]]:
    """Input items as chat messages (consecutive function calls join one assistant turn)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        else:
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    return messages


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description, "parameters": tool.parameters}
    if tool.strict is not None:
        function["strict"] = tool.strict
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _chat_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    schema = {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}
    return {
        "type": "json_schema",
        "json_schema": {k: v for k, v in schema.items() if v is not None},
    }

"""Anthropic Messages API request bodies (pydantic), and the chat request each one means.

`POST /v1/messages` is a thin layer over the chat endpoint: `MessagesRequest.to_chat()`
builds the `ChatCompletionRequest` that says the same thing, and `serving_messages`
translates the chat answer back.

    Messages                              chat
    system (string or text blocks)        a first system message
    text blocks                           text content parts
    tool_use blocks (assistant)           tool_calls, arguments as JSON
    tool_result blocks (user)             tool messages (is_error: content marked "Error: ")
    tools {name, description,             tools {type: function, function: {name,
           input_schema}                         description, parameters}}
    tool_choice auto / any / tool / none  auto / required / named function / none
    stop_sequences, metadata.user_id      stop, user

Every field Anthropic defines is honoured, accepted because it cannot change what ember
produces (`metadata`, `cache_control`: ember caches every prefix by itself,
`service_tier`, ...), or refused with a 400 naming it (`_REFUSED`, images and the other
block types ember cannot read, `thinking` while the model has no reasoning parser); a
final assistant message is a prefill the answer goes on from (the chat path's
`continue_final_message`); fields Anthropic does not define are refused too.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)

from ember.sampling_params import BOUNDS
from ember.server.errors import describe
from ember.server.limits import MAX_MESSAGES, MAX_TOOLS
from ember.server.protocol import ChatCompletionRequest


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextBlock(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None
    citations: list[dict[str, Any]] | None = None

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, value: list | None) -> list | None:
        if value:
            raise ValueError("citations are not supported by ember")
        return value


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None


class OtherBlock(BaseModel):
    """A block of a type ember cannot read (image, document, thinking, ...): the
    translation refuses it with a 400 naming where it is."""

    model_config = ConfigDict(extra="allow")
    type: str


def _block_type(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "tool_use", "tool_result") else "other"


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[Block] | None = None
    is_error: bool = False
    cache_control: dict[str, Any] | None = None


Block = Annotated[
    Annotated[TextBlock, Tag("text")]
    | Annotated[ToolUseBlock, Tag("tool_use")]
    | Annotated[ToolResultBlock, Tag("tool_result")]
    | Annotated[OtherBlock, Tag("other")],
    Discriminator(_block_type),
]
ToolResultBlock.model_rebuild()


class InputMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ToolDefinition(_Body):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError('tool_choice.name is required with type "tool", and only then')
        return self


class Metadata(_Body):
    user_id: str | None = None  # accepted; the router keys session affinity on it


# Anthropic's fields that would change the answer and that ember does not implement
_REFUSED = ("container", "diagnostics", "output_config", "mcp_servers", "context_management")


class MessagesRequest(_Body):
    # the router runs Messages requests whole: never a prefill/decode hand-off
    kv_transfer_params: ClassVar[None] = None

    model: str
    max_tokens: int = Field(**BOUNDS["max_tokens"].schema())
    messages: list[InputMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[Annotated[str, Field(min_length=1)]] | None = None
    temperature: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    top_p: float | None = Field(None, **BOUNDS["top_p"].schema())
    top_k: int | None = Field(None, **BOUNDS["top_k"].schema())
    stream: bool = False
    tools: list[ToolDefinition] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    metadata: Metadata | None = None
    # accepted; none of them changes what ember produces
    cache_control: dict[str, Any] | None = None
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # ember's own, as on the chat endpoint: keeps one tenant's prefix cache apart, and
    # keeps the prompt's KV as an agent session's
    cache_salt: str | None = None
    kv_retention: Literal["session"] | None = None
    seed: int | None = Field(None, **BOUNDS["seed"].schema())  # as on the chat endpoint
    resume_params: dict[str, Any] | None = None  # ember's router only (server/resume.py)
    # refused unless null (see _REFUSED)
    container: Any = None
    diagnostics: Any = None
    output_config: Any = None
    mcp_servers: Any = None
    context_management: Any = None

    @property
    def wants_thinking(self) -> bool:
        return self.thinking is not None and self.thinking.get("type") != "disabled"

    def to_chat(self, reasoning: bool = False) -> ChatCompletionRequest:
        """The chat request that means the same. `reasoning`: the model has a reasoning
        parser (its thinking comes back as thinking blocks, whatever `thinking` says, so a
        budget or `disabled` is refused rather than ignored). ValueError names what ember
        cannot honour."""
        self._check_refused(reasoning)
        messages = _system_messages(self.system)
        for i, message in enumerate(self.messages):
            messages += _chat_messages(message, f"messages.{i}")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop_sequences or None,
            "stream": self.stream,
            "user": self.metadata.user_id if self.metadata else None,
            "cache_salt": self.cache_salt,
            "seed": self.seed,
            **self._chat_tools(),
        }
        if self.messages[-1].role == "assistant":  # prefill: the answer goes on from it
            body.update(continue_final_message=True, add_generation_prompt=False)
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:
            raise ValueError(describe(exc.errors()[0])[1]) from None

    def _check_refused(self, reasoning: bool) -> None:
        for name in _REFUSED:
            if getattr(self, name) is not None:
                raise ValueError(f"{name} is not supported by ember")
        if self.wants_thinking:  # a budget ember cannot hold the model to
            raise ValueError(
                "thinking: ember cannot bound a model's thinking to budget_tokens; leave "
                "`thinking` out (a model with a reasoning parser returns its thinking as "
                "thinking blocks without it)"
                if reasoning
                else "thinking is not supported for this model (it has no reasoning parser)"
            )
        if self.thinking is not None and reasoning:  # {"type": "disabled"}
            raise ValueError("thinking: ember cannot switch off this model's thinking")
        for i, tool in enumerate(self.tools or []):
            if tool.strict:
                raise ValueError(f"tools.{i}.strict is not supported by ember")
        if self.messages[-1].role == "assistant":
            self._check_prefill(reasoning)

    def _check_prefill(self, reasoning: bool) -> None:
        """A final assistant message is text the answer goes on from (Anthropic's prefill):
        text blocks only, not ending in whitespace (Anthropic refuses that too), and not
        for a model whose reasoning parser reads the answer from its start."""
        where = f"messages.{len(self.messages) - 1}"
        content = self.messages[-1].content
        blocks = [TextBlock(type="text", text=content)] if isinstance(content, str) else content
        if not all(isinstance(block, TextBlock) for block in blocks):
            raise ValueError(f"{where}: a final assistant message (prefill) must be text only")
        text = "".join(block.text for block in blocks)
        if text != text.rstrip():
            raise ValueError(
                f"{where}: final assistant content cannot end with trailing whitespace"
            )
        if reasoning:
            raise ValueError(
                f"{where}: a final assistant message (prefill) is not supported for a model "
                "with a reasoning parser"
            )

    def _chat_tools(self) -> dict[str, Any]:
        fields: dict[str, Any] = {}
        if self.tools:
            fields["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": tool.name,
                        "description": tool.description,
                        "parameters": tool.input_schema,
                    },
                }
                for tool in self.tools
            ]
        choice = self.tool_choice
        if choice is None:
            return fields
        if choice.type == "tool":  # one call by construction: disable_parallel_tool_use holds
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
            return fields
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
        return fields


def _system_messages(system: str | list[TextBlock] | None) -> list[dict]:
    if not system:
        return []
    if isinstance(system, str):
        return [{"role": "system", "content": system}]
    return [{"role": "system", "content": [_text_part(block) for block in system]}]


def _chat_messages(message: InputMessage, where: str) -> list[dict]:
    """The chat messages one Messages turn becomes (a user turn's tool results become
    tool messages, in their order among its text)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        return [_assistant_message(message.content, where)]
    out: list[dict] = []
    parts: list[dict] = []
    for j, block in enumerate(message.content):
        if isinstance(block, ToolResultBlock):
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            out.append(_tool_message(block, f"{where}.content.{j}"))
        elif isinstance(block, TextBlock):
            parts.append(_text_part(block))
        else:
            raise _unsupported(block, f"{where}.content.{j}")
    if parts or not out:
        out.append({"role": "user", "content": parts})
    return out


def _assistant_message(blocks: list, where: str) -> dict:
    parts: list[dict] = []
    calls: list[dict] = []
    for j, block in enumerate(blocks):
        if isinstance(block, TextBlock):
            parts.append(_text_part(block))
        elif isinstance(block, ToolUseBlock):
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
        else:
            raise _unsupported(block, f"{where}.content.{j}")
    message: dict = {"role": "assistant", "content": parts or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _tool_message(block: ToolResultBlock, where: str) -> dict:
    content = block.content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            if not isinstance(part, TextBlock):
                raise _unsupported(part, f"{where}.content.{k}")
            texts.append(part.text)
        content = "".join(texts)
    content = content or ""
    if block.is_error:
        content = f"Error: {content}"
    return {"role": "tool", "tool_call_id": block.tool_use_id, "content": content}


def _text_part(block: TextBlock) -> dict:
    return {"type": "text", "text": block.text}


def _unsupported(block: BaseModel, where: str) -> ValueError:
    kind = getattr(block, "type", "?")
    if isinstance(block, ToolUseBlock | ToolResultBlock):
        return ValueError(f"{where}: a {kind} block is not allowed in this place")
    return ValueError(f"{where}: {kind} content is not supported by ember (text only)")

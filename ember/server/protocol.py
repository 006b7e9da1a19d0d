"""OpenAI request bodies (pydantic), and their translation into engine sampling parameters.

Fields the OpenAI API defines but ember does not use (metadata, store, ...) are accepted
and ignored, as OpenAI-compatible servers do, so that unchanged clients keep working.
Responses are built as plain dicts in `serving` (no validation cost per streamed chunk).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ember.sampling_params import MAX_LOGPROBS, SamplingParams


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: dict[str, str]


class JsonSchemaFormat(_Request):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Request):
    """Parameters shared by both endpoints."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    # disaggregation, set by `ember router`: {"do_remote_decode": true} to a prefill
    # worker, the prefill's answer ({"remote_prefill": ...}) to a decode worker
    kv_transfer_params: dict | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the parameter when a value is out of range."""
        return SamplingParams(
            n=self.n,
            temperature=_or(self.temperature, 1.0),
            top_p=_or(self.top_p, 1.0),
            top_k=_or(self.top_k, 0),
            min_p=_or(self.min_p, 0.0),
            presence_penalty=_or(self.presence_penalty, 0.0),
            frequency_penalty=_or(self.frequency_penalty, 0.0),
            repetition_penalty=_or(self.repetition_penalty, 1.0),
            seed=self.seed,
            max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True

    def to_sampling_params(self) -> SamplingParams:
        top = self.top_logprobs
        if top is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top}")
        max_tokens = _or(self.max_completion_tokens, self.max_tokens)
        if max_tokens is not None and max_tokens < 1:
            name = "max_completion_tokens" if self.max_completion_tokens else "max_tokens"
            raise ValueError(f"{name} must be >= 1, got {max_tokens}")
        return self.sampling_params(max_tokens, (top or 0) if self.logprobs else None)


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    def to_sampling_params(self) -> SamplingParams:
        if self.echo:
            raise ValueError("echo is not supported")
        return self.sampling_params(self.max_tokens, self.logprobs)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)


def _or(value, default):
    return default if value is None else value

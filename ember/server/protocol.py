"""OpenAI request bodies (pydantic), and their translation into engine sampling parameters.

Every number has its range in the schema (`BOUNDS`, shared with SamplingParams), so
/openapi.json says what is refused; a violation is a 400 naming the field. What ember does
with each field is the table in `fields.py`: fields that change nothing in the output
(metadata, store, ...) are accepted and ignored, as OpenAI-compatible servers do, so that
unchanged clients keep working; fields that would change the output and that ember does
not implement (use_beam_search, ...) are refused when set, never silently ignored.
Responses are built as plain dicts in `serving` (no validation cost per streamed chunk).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator

from ember.engine.processor import Truncation
from ember.sampling_params import (
    BOUNDS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_SEQUENCES,
    TOKEN_ID,
    SamplingParams,
)
from ember.server.fields import Api, refused
from ember.server.limits import MAX_MESSAGES, MAX_TEMPLATE_KWARGS, MAX_TOOLS

TokenId = Annotated[int, Field(**TOKEN_ID.schema())]
Text = Annotated[str, Field(min_length=1)]
Bias = Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,19}$")]


def _prompt_form(value: Any) -> str:
    """Which form of prompt a value is meant as (its errors are then about that form)."""
    if not isinstance(value, list):
        return "str"
    first = value[0] if value else None
    if isinstance(first, str):
        return "list[str]"
    return "list[list[int]]" if isinstance(first, list) else "list[int]"


# text, texts, token ids or lists of token ids; never empty (the tags name the forms in
# errors, which `errors` leaves out of `param`)
Prompt = Annotated[
    Annotated[Text, Tag("str")]
    | Annotated[list[Text], Field(min_length=1), Tag("list[str]")]
    | Annotated[list[TokenId], Field(min_length=1), Tag("list[int]")]
    | Annotated[
        list[Annotated[list[TokenId], Field(min_length=1)]],
        Field(min_length=1),
        Tag("list[list[int]]"),
    ],
    Discriminator(_prompt_form),
]


StopText = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
# one stop string or a list of them (the tags name the forms in errors, as for Prompt)
Stop = Annotated[
    Annotated[StopText, Tag("str")]
    | Annotated[list[StopText], Field(max_length=MAX_STOP_SEQUENCES), Tag("list[str]")],
    Discriminator(lambda value: "list[str]" if isinstance(value, list) else "str"),
]


def _bounded(name: str, default: int | float | None = None) -> Any:
    return Field(default, **BOUNDS[name].schema())


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(RequestModel):
    include_usage: bool = False  # a last chunk with the usage
    continuous_usage_stats: bool = False  # vLLM's: the usage so far in every chunk
    include_obfuscation: bool | None = None  # irrelevant: no padding to obfuscate


class FunctionCall(RequestModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(RequestModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # OpenAI's strict rules checked on parameters (chat.py)


class Tool(RequestModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedToolChoice(RequestModel):
    type: Literal["function"] = "function"
    function: dict[str, str]


class JsonSchemaFormat(RequestModel):
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(RequestModel):
    """Parameters shared by both endpoints (which each are, `fields.FIELDS` says)."""

    _API: ClassVar[Api]

    model: str | None = None
    n: int = _bounded("n", 1)
    temperature: float | None = _bounded("temperature")
    top_p: float | None = _bounded("top_p")
    top_k: int | None = _bounded("top_k")
    min_p: float | None = _bounded("min_p")
    seed: int | None = _bounded("seed")
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    presence_penalty: float | None = _bounded("presence_penalty")
    frequency_penalty: float | None = _bounded("frequency_penalty")
    repetition_penalty: float | None = _bounded("repetition_penalty")
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:N"
    # vLLM's: keep that many of the prompt's tokens (-1: all that leave room for max_tokens)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=2**63 - 1)
    truncation_side: Literal["left", "right"] | None = None  # "left": the start goes
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    # ember's: keep this prompt's KV as an agent session's (as x-session-affinity does)
    kv_retention: Literal["session"] | None = None
    # disaggregation, set by `ember router`: {"do_remote_decode": true} to a prefill
    # worker, the prefill's answer ({"remote_prefill": ...}) to a decode worker
    kv_transfer_params: dict | None = None
    # set by `ember router` only: a stream moved here from a failed worker (server/resume.py)
    resume_params: dict | None = None
    logit_bias: dict[TokenIdKey, Bias] | None = None
    min_tokens: int | None = _bounded("min_tokens")
    prompt_logprobs: int | None = _bounded("prompt_logprobs")  # completions only
    # refused unless null or harmless (fields.FIELDS)
    use_beam_search: bool | None = None
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    structured_outputs: Any = None
    thinking_token_budget: Any = None
    spaces_between_special_tokens: Any = None
    length_penalty: Any = None
    logprob_token_ids: Any = None
    return_token_ids: Any = None
    return_token_offsets: Any = None
    priority: Any = None
    request_id: Any = None
    session_id: Any = None
    stream_interval: Any = None
    repetition_detection: Any = None
    watermarking: Any = None
    vllm_xargs: Any = None
    ec_transfer_params: Any = None
    routed_experts_prompt_start: Any = None
    # irrelevant to the output (fields.FIELDS)
    mm_payload: Any = None
    return_mm_kwargs: Any = None

    @field_validator("*", mode="before")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        """No lone surrogates anywhere in a field (JSON allows them; UTF-8, the tokenizer
        and the engine's wire cannot carry them)."""
        if not valid_unicode(value):
            raise ValueError("strings must be valid Unicode (a lone surrogate is not)")
        return value

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        """Raises ValueError naming the parameter when a value is out of range or refused."""
        for name, no_ops in refused(self._API).items():
            value = getattr(self, name)
            if value is not None and value not in no_ops and not self._no_op(name, value):
                raise ValueError(f"{name} is not supported by ember")
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
            logit_bias={int(t): bias for t, bias in (self.logit_bias or {}).items()},
            min_tokens=_or(self.min_tokens, 0),
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _no_op(self, name: str, value: Any) -> bool:
        """Whether a refused field's value changes nothing, given the other fields."""
        return False

    def truncation(self) -> Truncation | None:
        if self.truncate_prompt_tokens is None:
            return None
        return Truncation(self.truncate_prompt_tokens, self.truncation_side)

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(_Sampling):
    _API: ClassVar[Api] = "chat"

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = _bounded("max_tokens")
    max_completion_tokens: int | None = _bounded("max_tokens")
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last message (assistant's) goes on
    chat_template_kwargs: dict[str, Any] | None = Field(None, max_length=MAX_TEMPLATE_KWARGS)
    add_special_tokens: bool = False  # the template writes them
    include_reasoning: bool = True  # vLLM's: false drops reasoning_content
    # irrelevant to the output (fields.FIELDS)
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    safety_identifier: Any = None
    prompt_cache_key: Any = None
    prediction: Any = None
    # refused unless null or harmless (fields.FIELDS)
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    web_search_options: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    echo: Any = None
    documents: Any = None
    chat_template: Any = None
    return_prompt_text: Any = None
    # irrelevant to the output (fields.FIELDS)
    mm_processor_kwargs: Any = None
    media_io_kwargs: Any = None

    def to_sampling_params(self) -> SamplingParams:
        top = self.top_logprobs
        if top is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = _or(self.max_completion_tokens, self.max_tokens)
        return self.sampling_params(max_tokens, (top or 0) if self.logprobs else None)


class CompletionRequest(_Sampling):
    _API: ClassVar[Api] = "completions"

    prompt: Prompt
    max_tokens: int | None = _bounded("max_tokens", 16)
    logprobs: int | None = _bounded("logprobs")
    echo: bool | None = False  # the prompt first (with logprobs, its tokens' logprobs)
    add_special_tokens: bool = True  # the tokenizer's BOS (and the like) before the prompt
    response_format: ResponseFormat | None = None  # vLLM's: JSON, as chat's
    # refused unless null or harmless (fields.FIELDS)
    best_of: int | None = None
    suffix: str | None = None
    prompt_embeds: Any = None

    def to_sampling_params(self) -> SamplingParams:
        return self.sampling_params(self.max_tokens, self.logprobs)

    def _no_op(self, name: str, value: Any) -> bool:
        return name == "best_of" and value == self.n

    def _prompt_logprobs(self) -> int | None:
        """How many alternatives to each prompt token the engine must return."""
        wanted = [self.prompt_logprobs, self.logprobs if self.echo else None]
        return max((n for n in wanted if n is not None), default=None)

    def prompts(self) -> list[str | list[int]]:
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        return list(prompt)


def _or(value, default):
    return default if value is None else value


def valid_unicode(value: Any) -> bool:
    """Whether every string in a JSON value (keys too) can be encoded as UTF-8."""
    stack = [value]
    while stack:  # not recursive: the value may be nested as deep as JSON allows
        item = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode()
                except UnicodeEncodeError:
                    return False
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
    return True

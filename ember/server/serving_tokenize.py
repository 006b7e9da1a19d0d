"""POST /tokenize and POST /detokenize, in vLLM's shapes: the served model's own tokenizer
and chat template, so clients and routers can count tokens exactly as generation will.

/tokenize takes a `prompt` (text; the tokenizer's special tokens added unless
`add_special_tokens` is false) or chat `messages` (+ `tools`, `add_generation_prompt`, `continue_final_message`,
`chat_template_kwargs`; rendered by the same code as /v1/chat/completions, whose template holds the special
tokens already, so none are added unless asked) and answers
`{"count", "max_model_len", "tokens", "token_strs"}` (`token_strs` with
`return_token_strs`, else null). /detokenize takes `tokens` and answers `{"prompt"}`.
Both tokenize in a thread, as the completions path does; neither runs the engine.
"""

from __future__ import annotations

import asyncio
from typing import Any, ClassVar

from pydantic import Field, field_validator

from ember.server.chat import ToolPlan, render_prompt
from ember.server.errors import APIError
from ember.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    RequestModel,
    TokenId,
    Tool,
    valid_unicode,
)
from ember.server.serving import ServingBase


class _TokenizerRequest(RequestModel):
    @field_validator("*", mode="before")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        if not valid_unicode(value):
            raise ValueError("strings must be valid Unicode (a lone surrogate is not)")
        return value


class TokenizeRequest(_TokenizerRequest):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one body: `prompt` or
    `messages`."""

    # set to anything but these values, a field is refused (ember's chat does not have it)
    _REFUSED: ClassVar[dict[str, tuple]] = {
        "chat_template": (),
    }

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    tools: list[Tool] | None = None
    add_special_tokens: bool | None = None  # default: true for prompt, false for messages
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        """ValueError naming the field that is wrong."""
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("prompt: give either prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools: only with messages")
        for name, harmless in self._REFUSED.items():
            value = getattr(self, name)
            if value is not None and value not in harmless:
                raise ValueError(f"{name} is not supported by ember")


class DetokenizeRequest(_TokenizerRequest):
    model: str | None = None
    tokens: list[TokenId]


class TokenizeServing(ServingBase):
    async def tokenize(self, request: TokenizeRequest) -> dict:
        self.check_model(request.model)
        try:
            request.check()
        except ValueError as exc:
            raise APIError.bad_request(exc) from None
        try:
            ids = await asyncio.to_thread(self._token_ids, request)
            strs = None
            if request.return_token_strs:
                strs = await asyncio.to_thread(self.llm.tokenizer.convert_ids_to_tokens, ids)
        except ValueError as exc:
            error = APIError.bad_request(exc)
            if error.param == "prompt" and request.messages is not None:
                error.param = "messages"  # a rendered chat too long to fit
            raise error from None
        return {
            "count": len(ids),
            "max_model_len": self.llm.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    def _token_ids(self, request: TokenizeRequest) -> list[int]:
        """The ids the prompt, or the chat as chat completions render it, is made of."""
        if request.messages is None:
            special = request.add_special_tokens is not False
            return self.llm.process_prompt(request.prompt, special).prompt_token_ids
        chat = ChatCompletionRequest(
            messages=request.messages,
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template_kwargs=request.chat_template_kwargs,
        )
        plan = ToolPlan("auto" if request.tools else "none")
        text = render_prompt(self.llm.tokenizer, chat, plan)
        return self.llm.process_prompt(text, bool(request.add_special_tokens)).prompt_token_ids

    async def detokenize(self, request: DetokenizeRequest) -> dict:
        self.check_model(request.model)
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise APIError(400, "tokens: this model has no tokenizer", "tokens", "invalid_value")
        vocab = self.llm.input_processor.vocab_size
        outside = [t for t in request.tokens if t >= vocab]
        if outside:
            message = f"tokens must be token ids in [0, {vocab}), got {outside[0]}"
            raise APIError(400, message, "tokens", "invalid_value")
        return {"prompt": await asyncio.to_thread(tokenizer.decode, request.tokens)}

"""Input side of the frontend: validates a prompt and its parameters, builds core requests.

Runs where the tokenizer lives (the API process in a server); the engine core gets
token ids and checked parameters only. A request with n > 1 becomes n core requests
`{id}#{i}`; each after the first waits for the first's prompt blocks and shares them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ember.engine.request import Request
from ember.sampling_params import SamplingParams


@dataclass(frozen=True)
class ProcessedPrompt:
    prompt: str | None
    prompt_token_ids: list[int]


class InputProcessor:
    def __init__(
        self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int]
    ):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids

    def tokenize(self, prompt: str | list[int]) -> ProcessedPrompt:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            return ProcessedPrompt(prompt, self.tokenizer.encode(prompt))
        ids = list(prompt)
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        return ProcessedPrompt(None, ids)

    def make_requests(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        cache_salt: str | None = None,
    ) -> list[Request]:
        """Core requests for one user request (n of them), after checking lengths."""
        max_tokens = self._max_tokens(len(prompt.prompt_token_ids), params)
        if params.n == 1:
            return [self._request(request_id, prompt, params, max_tokens, cache_salt, None)]
        requests: list[Request] = []
        for i in range(params.n):
            child_params = params
            if params.seed is not None:
                child_params = replace(params, seed=params.seed + i)
            first = requests[0] if requests else None
            requests.append(
                self._request(
                    f"{request_id}#{i}", prompt, child_params, max_tokens, cache_salt, first
                )
            )
        return requests

    def check(self, prompt: ProcessedPrompt, params: SamplingParams) -> int:
        """Checks that the prompt and max_tokens fit the context; returns max_tokens."""
        return self._max_tokens(len(prompt.prompt_token_ids), params)

    def _max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        if num_prompt_tokens == 0:
            raise ValueError("prompt must not be empty")
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise ValueError(
                f"prompt has {num_prompt_tokens} tokens, but max_model_len is "
                f"{self.max_model_len} (at least one token must be left to generate)"
            )
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} "
                f"tokens exceeds max_model_len={self.max_model_len}"
            )
        return params.max_tokens

    def _request(self, request_id, prompt, params, max_tokens, cache_salt, wait_for):
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt.prompt_token_ids,
            sampling_params=params,
            max_tokens=max_tokens,
            eos_token_ids=self.eos_token_ids,
            cache_salt=cache_salt,
            wait_for=wait_for,
        )

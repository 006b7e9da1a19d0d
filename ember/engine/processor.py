"""Input side of the frontend: validates a prompt and its parameters for the core.

Runs where the tokenizer lives (the API process in a server); the engine core gets
token ids and checked parameters only, as one `EngineCoreRequest`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ember.engine.messages import EngineCoreRequest
from ember.kv.params import KVTransferParams
from ember.model_config import ModelConfig
from ember.sampling_params import SamplingParams


@dataclass(frozen=True)
class Truncation:
    """vLLM's `truncate_prompt_tokens`: keep `keep` of the prompt's tokens (-1: as many as
    leave room for max_tokens), the last ones ("left": the start goes) or the first
    ("right"); `side` None is the tokenizer's own (`truncation_side`, "right" unless it
    says otherwise), as vLLM does."""

    keep: int
    side: str | None = None


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
        self.longest_token = _longest_token(tokenizer)

    @property
    def max_prompt_chars(self) -> int:
        """A length no text of at most max_model_len tokens reaches: that many of the
        longest token, twice over (normalizers may fold a few characters into one)."""
        return 2 * self.longest_token * self.max_model_len

    @classmethod
    def for_model(cls, tokenizer, model_config: ModelConfig, max_model_len: int) -> InputProcessor:
        """EOS ids are the model config's plus the tokenizer's own."""
        eos = set(model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return cls(tokenizer, model_config.vocab_size, max_model_len, frozenset(eos))

    def tokenize(
        self,
        prompt: str | list[int],
        add_special_tokens: bool = True,
        truncation: Truncation | None = None,
        max_tokens: int | None = None,
    ) -> ProcessedPrompt:
        """Token ids of a text (with the tokenizer's BOS and the like, unless the text is a
        rendered chat template, which has them already) or checked token ids, cut to
        `truncation` (which `max_tokens` sizes when it keeps -1). A text too long to fit
        the context is refused before it is tokenized; truncated, it is cut to that many
        characters first, on the side that goes (so its tokenizing stays bounded)."""
        side = None
        if truncation is not None:
            side = truncation.side or getattr(self.tokenizer, "truncation_side", None) or "right"
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompt: this model has no tokenizer; pass token ids")
            if len(prompt) > self.max_prompt_chars:
                if side is None:
                    raise ValueError(
                        f"prompt has {len(prompt)} characters, more than max_model_len="
                        f"{self.max_model_len} tokens of this tokenizer can hold"
                    )
                cut = self.max_prompt_chars
                prompt = prompt[-cut:] if side == "left" else prompt[:cut]
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            processed = ProcessedPrompt(prompt, ids)
        else:
            ids = list(prompt)
            if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
                raise ValueError(f"prompt token ids must be integers in [0, {self.vocab_size})")
            processed = ProcessedPrompt(None, ids)
        if truncation is None:
            return processed
        keep = self._keep(truncation.keep, max_tokens)
        if keep >= len(processed.prompt_token_ids):
            return processed
        ids = processed.prompt_token_ids
        ids = ids[len(ids) - keep :] if side == "left" else ids[:keep]
        return ProcessedPrompt(None, ids)  # its text: the kept tokens'

    def _keep(self, keep: int, max_tokens: int | None) -> int:
        if keep == -1:
            return max(self.max_model_len - (max_tokens or 1), 0)
        if not 0 <= keep <= self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens must be -1 or 0 to max_model_len={self.max_model_len}"
                f", got {keep}"
            )
        return keep

    def process(
        self,
        request_id: str,
        prompt: ProcessedPrompt,
        params: SamplingParams,
        cache_salt: str | None = None,
        session_id: str | None = None,
        grammar: str | None = None,
        kv_transfer: KVTransferParams | None = None,
        kv_retention: str | None = None,
        resume_token_ids: list[int] | None = None,
    ) -> EngineCoreRequest:
        """The message for the core, after checking that prompt and max_tokens fit.

        A prefill for a decode worker (`kv_transfer.do_remote_decode`) runs to its first
        token only; when that first token is all the request wants, it is an ordinary
        request (nothing to hand over). `resume_token_ids`: a stream resumed from another
        worker, the tokens output there (they count towards max_tokens).
        """
        max_tokens = self.check(prompt, params)
        if resume_token_ids is not None:
            self._check_resume(resume_token_ids, params, max_tokens, kv_transfer)
        if kv_retention not in (None, "session"):
            raise ValueError(f"kv_retention must be 'session' or None, got {kv_retention!r}")
        if kv_transfer is not None and params.n != 1:
            raise ValueError("kv_transfer_params: only requests with n = 1 can be disaggregated")
        remote = kv_transfer.remote_prefill if kv_transfer is not None else None
        if kv_transfer is not None and params.prompt_logprobs is not None:
            if remote is not None:
                raise ValueError("kv_transfer_params: prompt logprobs need the whole prompt here")
            kv_transfer = None  # computed whole here: the router relays this answer
        if remote is not None and not all(t < self.vocab_size for t in remote.first_token_ids):
            raise ValueError(
                f"kv_transfer_params: first_token_ids must be in [0, {self.vocab_size})"
            )
        if kv_transfer is not None and kv_transfer.do_remote_decode:
            if max_tokens > 1:
                max_tokens = 1
            else:
                kv_transfer = None
        return EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt.prompt_token_ids,
            params=params,
            max_tokens=max_tokens,
            eos_token_ids=sorted(self.eos_token_ids),
            cache_salt=cache_salt,
            session_id=session_id,
            grammar=grammar,
            kv_transfer=kv_transfer,
            kv_retention=kv_retention,
            resume_token_ids=resume_token_ids,
        )

    def _check_resume(
        self, token_ids: list[int], params: SamplingParams, max_tokens: int, kv_transfer
    ) -> None:
        if params.n != 1:
            raise ValueError("resume_params: only a request with n = 1 can be resumed")
        if kv_transfer is not None:
            raise ValueError("resume_params: a resumed request runs whole (no kv_transfer_params)")
        if len(token_ids) > max_tokens:
            raise ValueError(
                f"resume_params: {len(token_ids)} tokens are more than max_tokens={max_tokens}"
            )
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in token_ids):
            raise ValueError(f"resume_params: token_ids must be in [0, {self.vocab_size})")

    def resumed_finish(
        self, token_ids: list[int] | None, params: SamplingParams, max_tokens: int
    ) -> str | None:
        """How a resumed stream's tokens ended it already ("stop", "length"), if they did
        (its worker failed between its last tokens and its finish_reason)."""
        if not token_ids:
            return None
        last = token_ids[-1]
        if (not params.ignore_eos and last in self.eos_token_ids) or last in params.stop_token_ids:
            return "stop"
        return "length" if len(token_ids) >= max_tokens else None

    def check(self, prompt: ProcessedPrompt, params: SamplingParams) -> int:
        """Checks that the prompt and max_tokens fit the context and that the parameters'
        token ids are in the vocabulary; returns max_tokens."""
        self._check_vocabulary(params)
        return self._max_tokens(len(prompt.prompt_token_ids), params)

    def _check_vocabulary(self, params: SamplingParams) -> None:
        vocab = self.vocab_size
        outside = [t for t in params.stop_token_ids if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"stop_token_ids must be in [0, {vocab}), got {outside[0]}")
        outside = [t for t in params.logit_bias or () if not 0 <= t < vocab]
        if outside:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {outside[0]}")
        if params.top_k > vocab:
            raise ValueError(
                f"top_k must be -1 or 0 (off) or at most the vocabulary size {vocab}, "
                f"got {params.top_k}"
            )

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
            if params.min_tokens > room:
                raise ValueError(
                    f"min_tokens={params.min_tokens} plus the prompt's {num_prompt_tokens} "
                    f"tokens exceeds max_model_len={self.max_model_len}"
                )
            return room
        if params.max_tokens > room:
            raise ValueError(
                f"max_tokens={params.max_tokens} plus the prompt's {num_prompt_tokens} "
                f"tokens exceeds max_model_len={self.max_model_len}"
            )
        return params.max_tokens


def _longest_token(tokenizer) -> int:
    """Characters of the tokenizer's longest token (0: no tokenizer)."""
    if tokenizer is None:
        return 0
    return max(map(len, tokenizer.get_vocab()), default=1)

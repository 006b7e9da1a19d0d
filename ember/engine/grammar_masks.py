"""The engine core's side of grammar-constrained decoding (see `structured_output`).

`GrammarCompiler` (built lazily, once per engine: wrapping the tokenizer takes ~0.6 s)
makes one `GrammarMatcher` per sequence. Each step the sampler masks the logits of a
constrained row to the tokens the matcher allows (`apply_grammars`); after sampling the
request feeds the token back (`accept`), which says when the grammar is complete.
Speculative decoding cuts a request's drafts to what the grammar takes (`valid_prefix`)
and masks each verification row with the state after the drafts before it
(`masks_along`).
"""

from __future__ import annotations

import numpy as np
import torch

from ember.engine.structured_output import llguidance


class GrammarCompiler:
    def __init__(self, tokenizer, vocab_size: int) -> None:
        if tokenizer is None:
            raise ValueError("grammar: structured outputs need the model's tokenizer")
        import llguidance.hf

        self.vocab_size = vocab_size
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def matcher(self, grammar: str) -> GrammarMatcher:
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"grammar: {matcher.get_error()}")
        return GrammarMatcher(matcher, self.vocab_size)


class GrammarMatcher:
    """The grammar state of one sequence."""

    def __init__(self, matcher, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def allowed(self) -> torch.Tensor:
        """A bool mask over the vocabulary of the tokens that may come next."""
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self._vocab_size].astype(bool))

    def accept(self, token_id: int) -> bool:
        """Advances past a sampled token; True once the grammar allows nothing more."""
        self._matcher.consume_token(token_id)
        return self._matcher.is_stopped() or self._matcher.is_error()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` (draft tokens) the grammar takes from here, in order."""
        return self._matcher.validate_tokens(tokens) if tokens else 0

    def masks_along(self, tokens: list[int]) -> list[torch.Tensor]:
        """The masks from here and after each of `tokens` (which the grammar must take),
        len(tokens) + 1 of them; the state is left as it was."""
        masks = [self.allowed()]
        for token in tokens:
            self._matcher.consume_token(token)
            masks.append(self.allowed())
        self._matcher.rollback(len(tokens))
        return masks


def apply_grammars(logits: torch.Tensor, requests) -> torch.Tensor:
    """Masks (to -inf) the tokens each constrained row's grammar forbids."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return logits
    masks = torch.stack([requests[i].grammar.allowed() for i in rows]).to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits = logits.clone()
    logits[index] = logits[index].masked_fill(~masks, float("-inf"))
    return logits

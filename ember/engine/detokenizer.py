"""Incremental detokenization on top of `tokenizers`' DecodeStream.

DecodeStream buffers tokens until they form whole UTF-8 characters, so a character
split over several byte-level tokens is never garbled; seeding it with the prompt's
last tokens keeps sentencepiece / byte-level spacing as a full decode would have it.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 8  # prompt tokens given to the stream as context


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool):
        self._tokenizer = tokenizer._tokenizer  # the `tokenizers.Tokenizer` of a fast tokenizer
        context = _whole_characters(self._tokenizer, list(prompt_token_ids[-PROMPT_CONTEXT:]))
        self._stream = DecodeStream(context, skip_special_tokens)

    def add(self, token_ids: list[int]) -> str:
        """The text that `token_ids` complete (may be empty while a character is partial)."""
        pieces = [self._stream.step(self._tokenizer, t) for t in token_ids]
        return "".join(p for p in pieces if p)


def _whole_characters(tokenizer, context: list[int]) -> list[int]:
    """Drops trailing tokens of a character the prompt leaves unfinished: seeded with
    half a character, the stream would emit the whole context as new text."""
    while context and tokenizer.decode(context, skip_special_tokens=False).endswith("\ufffd"):
        context.pop()
    return context

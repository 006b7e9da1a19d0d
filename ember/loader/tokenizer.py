"""Loading a tokenizer directory, without torch where transformers allows it.

transformers' `AutoTokenizer` imports its model-config machinery, which imports torch
(about a second): the API process of `ember serve` needs neither. A directory whose
tokenizer_config.json names the plain fast tokenizer (`TokenizersBackend`, or
`PreTrainedTokenizerFast` before transformers 5; what ember's GGUF tokenizer cache
holds) is loaded with that class directly, which gives the same tokenizer; any other
goes through `AutoTokenizer`.
"""

from __future__ import annotations

import json
from pathlib import Path

PLAIN_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: str | Path):
    """The tokenizer saved in directory `path` (OSError / ValueError as transformers raises)."""
    if _tokenizer_class(Path(path)) in PLAIN_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def _tokenizer_class(path: Path) -> str | None:
    try:
        return json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None

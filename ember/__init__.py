"""ember: serving large language models to agentic workloads.

`LLM` is imported on first use: it brings torch, which the API process of `ember serve`
(and every other command that runs no model) does without.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ember.outputs import CompletionOutput, RequestOutput
from ember.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ember.llm import LLM

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from ember.llm import LLM

        return LLM
    raise AttributeError(f"module 'ember' has no attribute {name!r}")

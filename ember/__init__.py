"""ember: serving large language models to agentic workloads."""

from __future__ import annotations

from ember.llm import LLM
from ember.outputs import CompletionOutput, RequestOutput
from ember.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"

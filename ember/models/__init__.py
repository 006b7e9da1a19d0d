"""Model architectures written for ember's engine, keyed by config.json `architectures`."""

from __future__ import annotations

from torch import nn

from ember.models.deepseek_v3 import DeepseekV3ForCausalLM
from ember.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    MixtralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
    Qwen3MoeForCausalLM,
)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class for an `architectures` entry; a clear error lists the supported ones."""
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise ValueError(
            f"architecture {architecture!r} is not supported; supported: {supported}"
        ) from None

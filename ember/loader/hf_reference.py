"""transformers' own model for a checkpoint: the numerical oracle and benchmark peer."""

from __future__ import annotations

import torch

from ember.loader.checkpoint import Checkpoint


def transformers_model(checkpoint: Checkpoint, dtype: torch.dtype = torch.float32):
    """Loads the checkpoint with transformers' own loaders (its GGUF reader for .gguf)."""
    from transformers import AutoModelForCausalLM

    if checkpoint.is_gguf:
        path = checkpoint.path
        model = AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint.path), dtype=dtype)
    return model.eval()

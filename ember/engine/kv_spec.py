"""What a model keeps in the paged KV cache per token, declared by the model.

Every layer's cache is one tensor `[num_parts, num_blocks, block_size, num_heads,
head_dim]`: a part is one array per token (keys and values: two parts of the KV heads;
multi-head latent attention: one part, the compressed latent and the rotary key of one
"head"). The block pool counts blocks; the model runner sizes and allocates the tensors
from the spec; the transports move a block as its `num_parts` contiguous chunks per
layer; so nothing outside the model and its attention needs to know the layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVCacheSpec:
    num_parts: int  # 2: keys and values; 1: one latent vector per token (MLA)
    num_heads: int
    head_dim: int
    head_start: int = 0  # the model's first KV head among these (a tensor-parallel rank's)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """One layer's cache tensor."""
        return (self.num_parts, num_blocks, block_size, self.num_heads, self.head_dim)

    def token_bytes(self, dtype: torch.dtype) -> int:
        """Bytes one token takes in one layer."""
        return self.num_parts * self.num_heads * self.head_dim * dtype.itemsize

"""Multi-head latent attention (MLA) over a paged cache of latents.

A token's cache entry is one vector, `[latent (kv_lora_rank) | rotary key
(qk_rope_head_dim)]`, shared by every head: the cache is `KVCacheSpec(1, 1, kv_lora_rank
+ qk_rope_head_dim)`, e.g. 576 values a token and layer for DeepSeek-V3's shapes, where
keys and values of its 128 heads would take 128 x (192 + 128) = 40960.
Each head's key is `[W_UK latent | rotary key]` and its value `W_UV latent`, W_UK and W_UV
being the head's rows of `kv_b_proj`. Two ways to attend, the same sums:

- prefill chunks expand: the context's latents go through `kv_b_proj` into keys and
  values of every head, and attention is the usual softmax(q k^T) v (many queries share
  each expanded key);
- decodes stay in the latent space (W_UK absorbed into the query, W_UV applied to the
  output): a query `[q_nope W_UK | q_rope]` against the cache entries as they are, so a
  step reads kv_lora_rank + qk_rope_head_dim values per context token, not 2 x heads x
  head size, and nothing is expanded.

torch ops throughout (CPU and CUDA).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ember.engine.attention import AttentionMetadata, PrefillSeq, causal_mask, gather_blocks


@dataclass
class MLAWeights:
    """What attention needs from a layer: `kv_b` [heads * (nope + v), kv_lora_rank] (the
    up-projection of the latent), the split sizes and the softmax scale."""

    kv_b: torch.Tensor
    num_heads: int
    qk_nope_head_dim: int
    v_head_dim: int
    kv_lora_rank: int
    scale: float

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope, lora] and W_UV [heads, v, lora] (views of kv_b)."""
        w = self.kv_b.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, -1)
        return w[:, : self.qk_nope_head_dim], w[:, self.qk_nope_head_dim :]


class MLABackend:
    """Writes each token's latent entry into the cache, then attends: decodes in the
    latent space, prefill chunks expanded (module docstring)."""

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, heads, nope]
        q_rope: torch.Tensor,  # [T, heads, rope], rotated
        entry: torch.Tensor,  # [T, lora + rope]: latent, rotated key
        kv_cache: torch.Tensor,  # [1, blocks, block_size, 1, lora + rope]
        meta: AttentionMetadata,
        weights: MLAWeights,
        expand,  # latents [C, lora] -> [C, heads * (nope + v)] (the kv_b_proj layer)
    ) -> torch.Tensor:
        """The attention output [T, heads, v_head_dim] in the cache's dtype."""
        cache = kv_cache[0]
        cache.view(-1, cache.shape[-1]).index_copy_(0, meta.slot_mapping, entry.to(cache.dtype))
        num_tokens = q_nope.shape[0]
        out = q_nope.new_empty(num_tokens, weights.num_heads, weights.v_head_dim)
        if meta.num_decodes:
            decodes = slice(0, meta.num_decodes)
            out[decodes] = self.decode(q_nope[decodes], q_rope[decodes], cache, meta, weights)
        for seq in meta.prefills:
            chunk = slice(seq.query_start, seq.query_start + seq.query_len)
            out[chunk] = self.prefill(q_nope[chunk], q_rope[chunk], cache, seq, weights, expand)
        return out

    @staticmethod
    def decode(q_nope, q_rope, cache, meta: AttentionMetadata, weights: MLAWeights):
        w_uk, w_uv = weights.absorbed()
        w_uk, w_uv = w_uk.to(q_nope.dtype), w_uv.to(q_nope.dtype)
        lora = weights.kv_lora_rank
        # [heads, B, nope] @ [heads, nope, lora]: each head's query in the latent space
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_rope], dim=-1)  # [B, heads, lora + rope]
        context = gather_blocks(cache, meta.decode_block_table)[:, 0]  # [B, L, lora + rope]
        scores = torch.bmm(query, context.transpose(1, 2)) * weights.scale  # [B, heads, L]
        scores = scores.masked_fill(~meta.decode_mask[:, 0], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(query.dtype)
        out_latent = torch.bmm(probs, context[..., :lora])  # [B, heads, lora]
        # [heads, B, lora] @ [heads, lora, v]: each head's W_UV
        return torch.bmm(out_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    @staticmethod
    def prefill(q_nope, q_rope, cache, seq: PrefillSeq, weights: MLAWeights, expand):
        heads, nope, lora = weights.num_heads, weights.qk_nope_head_dim, weights.kv_lora_rank
        context = gather_blocks(cache, seq.block_ids.unsqueeze(0))[0, 0, : seq.context_len]
        kv = expand(context[:, :lora].contiguous()).to(q_nope.dtype)
        kv = kv.view(seq.context_len, heads, nope + weights.v_head_dim)
        k_rope = context[:, None, lora:].to(q_nope.dtype).expand(-1, heads, -1)
        keys = torch.cat([kv[..., :nope], k_rope], dim=-1)  # [C, heads, nope + rope]
        query = torch.cat([q_nope, q_rope], dim=-1)
        causal = seq.context_len == seq.query_len
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).unsqueeze(0),
            keys.transpose(0, 1).unsqueeze(0),
            kv[..., nope:].transpose(0, 1).unsqueeze(0),
            attn_mask=None if causal else causal_mask(seq.query_len, seq.context_len, query.device),
            is_causal=causal,
            scale=weights.scale,
        )
        return out[0].transpose(0, 1)

"""EAGLE-3 draft heads (Li et al., 2025) in the checkpoint format of the EAGLE authors,
SGLang and vLLM: config.json with `architectures: ["LlamaForCausalLMEagle3"]`, one
Llama decoder layer (`midlayer.*`), `fc`, `norm`, `lm_head` over `draft_vocab_size`
tokens, and `d2t` (draft id -> target id offsets; `t2d` is not needed).

The head predicts the token after next from the next token and the target's hidden
state: at position p it reads [input_layernorm(embed(t[p+1])) | hidden_norm(h[p])],
where h[p] is `fc` of the target's residual stream before a few of its layers
(ember.model_config.EagleConfig), and its layer's attention keys and values (over twice the
hidden size) go into a paged cache of its own. Its output before the final norm is the
hidden state its next position reads when it drafts further on its own.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ember.engine.attention import AttentionBackend
from ember.engine.kv_spec import KVCacheSpec
from ember.model_config import ModelConfig
from ember.models.layers import Linear, MergedLinear, RMSNorm, new_param
from ember.models.llama import LlamaDecoderLayer, LlamaForCausalLM, load_into
from ember.models.rotary import RotaryEmbedding


class Eagle3DecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(config, backend, 0)
        attn = self.self_attn
        q_size, kv_size = attn.num_heads * attn.head_dim, attn.num_kv_heads * attn.head_dim
        attn.qkv_proj = MergedLinear(
            2 * config.hidden_size, [q_size, kv_size, kv_size], bias=config.attention_bias
        )
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = config.eagle.norm_before_residual

    def forward(self, embeds, hidden, kv_cache, meta, cos_sin):
        """The layer's output before the final norm."""
        normed = self.hidden_norm(hidden)
        # a copy: the norm below adds to its residual in place
        residual = normed if self.norm_before_residual else hidden.clone()
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        x = self.self_attn(x, kv_cache, meta, cos_sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x) + residual


class Eagle3ForCausalLM(nn.Module):
    """An EAGLE-3 head; `share_embedding` gives it the target's table when the
    checkpoint has none (the usual case)."""

    fused_params = LlamaForCausalLM.fused_params

    @staticmethod
    def kv_cache_spec(config: ModelConfig) -> KVCacheSpec:
        return LlamaForCausalLM.kv_cache_spec(config)

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        eagle = config.eagle
        self.config = config
        self.num_aux = len(eagle.aux_layers) if eagle.aux_layers else 3
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = new_param(config.vocab_size, config.hidden_size)
        self.fc = Linear(eagle.target_hidden_size * self.num_aux, config.hidden_size)
        self.layer = Eagle3DecoderLayer(config, backend)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, eagle.draft_vocab_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, max_positions, config.rope)
        self.register_buffer("d2t", torch.zeros(eagle.draft_vocab_size, dtype=torch.long))
        self.has_own_embedding = False

    def share_embedding(self, weight: torch.Tensor) -> None:
        if not self.has_own_embedding:
            self.embed_tokens.weight = weight

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """The target's captured hidden states [T, layers * hidden] -> the head's [T, hidden]."""
        return self.fc(aux_hidden).to(aux_hidden.dtype)

    def forward(self, input_ids, positions, kv_caches, meta, hidden):
        """`input_ids[i]` is the token after the one whose state is `hidden[i]`."""
        dtype = hidden.dtype
        embeds = F.embedding(input_ids, self.embed_tokens.weight).to(dtype)
        cos_sin = self.rotary_emb.cos_sin(positions, dtype)
        return self.layer(embeds, hidden, kv_caches[0], meta, cos_sin).to(dtype)

    def draft_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        """Each row's logits over the draft vocabulary (`draft_ids` maps them)."""
        return self.lm_head(self.norm(prenorm))

    def target_ids(self, indices: torch.Tensor) -> torch.Tensor:
        """The target's token ids of draft vocabulary entries."""
        return indices + self.d2t[indices]

    @property
    def draft_ids(self) -> torch.Tensor:
        """The target's token id of each draft vocabulary entry."""
        return self.target_ids(torch.arange(len(self.d2t), device=self.d2t.device))

    def pack_for_cpu(self, bf16_prefill: bool = False, weight_dtype=None) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu(bf16_prefill, weight_dtype)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = _head_name(name)
            if name is None:
                continue
            if name == "d2t":
                if tensor.shape != self.d2t.shape:
                    raise ValueError(
                        f"EAGLE-3 head: d2t has shape {tuple(tensor.shape)}, expected "
                        f"{tuple(self.d2t.shape)} (draft_vocab_size)"
                    )
                self.d2t.copy_(tensor.to(torch.long))
                loaded.add(name)
                continue
            target, shard = LlamaForCausalLM._param_name(self, name)  # q/k/v, gate/up fused
            load_into(params, target, shard, tensor, f"EAGLE-3 head: {name}")
            loaded.add(target)
        self.has_own_embedding = "embed_tokens.weight" in loaded
        needed = set(params) - {"embed_tokens.weight"}
        if self.config.eagle.draft_vocab_size != self.config.vocab_size:
            needed.add("d2t")
        missing = sorted(needed - loaded)
        if missing:
            raise ValueError(f"EAGLE-3 head: the checkpoint lacks {missing[:4]}")


def _head_name(name: str) -> str | None:
    """A checkpoint name as the head's parameters go (`midlayer.` or `layers.0.` is
    `layer.`); None for tensors the head does not use."""
    name = name.removeprefix("model.")
    if name == "t2d" or "rotary_emb" in name:
        return None
    for prefix in ("midlayer.", "layers.0."):
        if name.startswith(prefix):
            return "layer." + name.removeprefix(prefix)
    return name

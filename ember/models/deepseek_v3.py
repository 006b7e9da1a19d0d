"""DeepSeek-V3 (and Kimi K2 / K2.5, which share its architecture): multi-head latent
attention over a cache of latents (ember.engine.mla) and a mixture of experts with
group-limited sigmoid routing and shared experts (ember.models.moe); the first
`first_k_dense_replace` layers keep a dense MLP.

Attribute names mirror transformers' modeling_deepseek_v3, so checkpoint keys map one to
one; gate/up of the dense and shared MLPs are fused into one matmul; routed experts
load from per-expert tensors (`mlp.experts.{e}.gate_proj.weight`, what published
checkpoints and transformers' save_pretrained write) or stacked ones
(`mlp.experts.gate_up_proj`, transformers' in-memory layout).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ember.config import MLAConfig, ModelConfig, yarn_mscale
from ember.engine.attention import AttentionBackend, AttentionMetadata
from ember.engine.kv_spec import KVCacheSpec
from ember.engine.mla import MLABackend, MLAWeights
from ember.models.layers import Linear, RMSNorm, RotaryEmbedding, apply_rotary, new_param
from ember.models.llama import moe_or_dense_mlp
from ember.models.moe import Experts, ExpertTensors

logger = logging.getLogger("ember.models")

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not the config's


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: MLABackend) -> None:
        super().__init__()
        mla: MLAConfig = config.mla
        self.mla = mla
        self.num_heads = heads = config.num_attention_heads
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        hidden, bias = config.hidden_size, config.attention_bias
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = Linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim))
        self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=bias)
        self.backend = backend
        self.scale = qk_head_dim**-0.5
        rope = config.rope
        if rope.rope_type != "default" and rope.mscale_all_dim:  # yarn's softmax scale
            self.scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2

    def forward(self, hidden, kv_cache, meta: AttentionMetadata, cos_sin):
        mla, dtype, num_tokens = self.mla, hidden.dtype, hidden.shape[0]
        if mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden).to(dtype)))
        q = q.to(dtype).view(num_tokens, self.num_heads, -1)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        compressed = self.kv_a_proj_with_mqa(hidden).to(dtype)
        latent, k_rope = compressed.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        # q's and k's rotary parts rotated in one go: [T, heads + 1, rope]
        rot = torch.cat([q_rope, k_rope.unsqueeze(1)], dim=1)
        if mla.rope_interleave:  # pairs (x0, x1), (x2, x3) ... -> halves, then rotate-half
            rot = torch.cat([rot[..., 0::2], rot[..., 1::2]], dim=-1)
        rot = apply_rotary(rot, *cos_sin)
        entry = torch.cat([latent, rot[:, -1]], dim=-1)  # what the cache keeps
        weights = MLAWeights(
            self.kv_b_proj.weight, self.num_heads, mla.qk_nope_head_dim, mla.v_head_dim,
            mla.kv_lora_rank, self.scale,
        )  # fmt: skip
        out = self.backend.forward(
            q_nope, rot[:, :-1], entry, kv_cache, meta, weights, self.kv_b_proj
        )
        return self.o_proj(out.reshape(num_tokens, -1))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: MLABackend, index: int) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, backend)
        self.mlp = moe_or_dense_mlp(config, index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, hidden, residual, kv_cache, meta, cos_sin):
        """Returns (this layer's MLP output, the residual stream before adding it)."""
        if residual is None:
            hidden, residual = self.input_layernorm(hidden), hidden
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(hidden, kv_cache, meta, cos_sin)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DeepseekV3Model(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        backend = MLABackend()
        self.embed_tokens = nn.Module()
        self.embed_tokens.weight = new_param(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DeepseekV3DecoderLayer(config, backend, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.mla.qk_rope_head_dim, max_positions, config.rope)

    def forward(self, input_ids, positions, kv_caches, meta):
        hidden = F.embedding(input_ids, self.embed_tokens.weight).to(self.norm.weight.dtype)
        cos_sin = self.rotary_emb.cos_sin(positions, hidden.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, kv_cache, meta, cos_sin)
        return hidden + residual


class MultiTokenPredictor(nn.Module):
    """One of DeepSeek-V3's multi-token-prediction (MTP) layers, `model.layers.{N + k}`
    after the N decoder layers: it would predict a token further ahead from the last
    layer's hidden state and the next token's embedding, `layer(eh_proj([enorm(embed) |
    hnorm(hidden)]))`, then `shared_head.norm` and the model's lm_head. Loaded and kept for
    speculative decoding; plain decoding never runs it. The embedding and output head are
    the main model's (the checkpoint's copies of them are not loaded)."""

    def __init__(self, config: ModelConfig, backend: MLABackend, index: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = RMSNorm(hidden, config.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, config.rms_norm_eps)
        self.eh_proj = Linear(2 * hidden, hidden)
        self.layer = DeepseekV3DecoderLayer(config, backend, index)
        self.shared_head_norm = RMSNorm(hidden, config.rms_norm_eps)


# checkpoint names that are not this model's: a multimodal wrapper's vision parts, and
# the copies of the embedding and output head in multi-token-prediction layers
_OTHER_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_MTP_COPIES = re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(nn.Module):
    fused_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @staticmethod
    def kv_cache_spec(config: ModelConfig) -> KVCacheSpec:
        """One latent vector and one rotary key per token and layer, for all heads."""
        return KVCacheSpec(1, 1, config.mla.kv_lora_rank + config.mla.qk_rope_head_dim)

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config, max_positions)  # MLA brings its own attention
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        backend = self.model.layers[0].self_attn.backend
        layers = config.num_hidden_layers
        self.mtp = nn.ModuleList(
            MultiTokenPredictor(config, backend, layers + k) for k in range(config.num_mtp_layers)
        )

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata):
        """Hidden states [T, hidden] of this step's tokens (before the final norm)."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.norm(hidden)).to(hidden.dtype)

    def pack_for_cpu(
        self, bf16_prefill: bool = False, weight_dtype: torch.dtype | None = None
    ) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack_for_cpu(bf16_prefill, weight_dtype)
            elif isinstance(module, Experts) and weight_dtype is not None:
                module.gate_up_proj.data = module.gate_up_proj.data.to(weight_dtype)
                module.down_proj.data = module.down_proj.data.to(weight_dtype)

    def load_gguf_blocks(self, blocks: Iterable[tuple[str, torch.Tensor]]) -> None:
        """GGUF block decoding is not wired for this architecture yet: every matmul reads
        its loaded weights."""
        for _ in blocks:
            pass

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copies checkpoint tensors (Hugging Face names) into the parameters."""
        params = dict(self.named_parameters())
        experts = ExpertTensors(self)
        loaded: set[str] = set()
        skipped = 0
        for name, tensor in weights:
            name = self._mtp_name(name.removeprefix("language_model."))
            if (
                name.startswith(_OTHER_PREFIXES)
                or _MTP_COPIES.match(name)
                or "rotary_emb" in name
                or (name == "lm_head.weight" and self.config.tie_word_embeddings)
            ):
                skipped += 1
                continue
            if experts.load(name, tensor):
                continue
            target, shard = self._param_name(name)
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} matches no parameter")
            param = params[target]
            tensor = tensor.to(param.dtype)
            if shard is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard)
            loaded.add(target)
        if skipped:
            logger.info(
                "%d checkpoint tensors are not used (copies in MTP layers, vision)", skipped
            )
        loaded |= experts.complete()
        if self.mtp and not any(name.startswith("mtp.") for name in loaded):
            logger.info("the checkpoint has no multi-token-prediction layers")
            self.mtp = nn.ModuleList()  # transformers' save_pretrained writes none
            params = dict(self.named_parameters())
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")

    def _mtp_name(self, name: str) -> str:
        """`model.layers.{N + k}.x` (an MTP layer's tensor) -> `mtp.{k}.x` or
        `mtp.{k}.layer.x`; other names as they are."""
        match = _LAYER.match(name)
        if match is None or int(match.group(1)) < self.config.num_hidden_layers:
            return name
        k = int(match.group(1)) - self.config.num_hidden_layers
        rest = name[match.end() :]
        if rest.startswith(("embed_tokens.", "shared_head.head.")):
            return name  # a copy of the main model's (skipped)
        if rest.startswith("shared_head.norm."):
            return f"mtp.{k}.shared_head_norm.{rest.removeprefix('shared_head.norm.')}"
        return f"mtp.{k}.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.{k}.layer.{rest}"

    def _param_name(self, name: str) -> tuple[str, int | None]:
        for part, (fused, shard) in self.fused_params.items():
            if f".{part}." in name:
                return name.replace(f".{part}.", f".{fused}."), shard
        return name, None

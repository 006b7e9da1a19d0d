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

import torch
import torch.nn.functional as F
from torch import nn

from ember.distributed.parallel import split, tp_group
from ember.engine.attention import AttentionBackend, AttentionMetadata
from ember.engine.kv_spec import KVCacheSpec
from ember.engine.mla import MLABackend, MLAWeights
from ember.model_config import MLAConfig, ModelConfig, yarn_mscale
from ember.models.layers import Linear, RMSNorm
from ember.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel
from ember.models.parallel_layers import ColumnParallelLinear, RowParallelLinear
from ember.models.rotary import apply_rotary

logger = logging.getLogger("ember.models")

LORA_NORM_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers' default, not the config's


class MLAttention(nn.Module):
    """Under tensor parallelism each rank holds a range of the heads (their rows of the
    q and kv_b up-projections, their columns of o_proj, summed over the ranks) and the
    whole latent path (q_a, kv_a and their norms): every rank computes and caches the
    same latents, as DeepSeek-V3 deployments with attention split by head do."""

    def __init__(self, config: ModelConfig, backend: MLABackend) -> None:
        super().__init__()
        mla: MLAConfig = config.mla
        self.mla = mla
        group = tp_group()
        first, self.num_heads = split(config.num_attention_heads, group.size, group.rank)
        heads = config.num_attention_heads
        qk_head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        kv_head_dim = mla.qk_nope_head_dim + mla.v_head_dim
        hidden, bias = config.hidden_size, config.attention_bias

        def rows(width: int) -> tuple[int, int]:  # this rank's heads' rows
            return first * width, self.num_heads * width

        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden, heads * qk_head_dim, group, rows(qk_head_dim)
            )
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(
                mla.q_lora_rank, heads * qk_head_dim, group, rows(qk_head_dim)
            )
        self.kv_a_proj_with_mqa = Linear(hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, bias)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, heads * kv_head_dim, group, rows(kv_head_dim)
        )
        if group.size > 1:
            if bias:
                raise ValueError("tensor_parallel_size > 1: MLA with attention_bias")
            self.o_proj = RowParallelLinear(
                heads * mla.v_head_dim, hidden, group, rows(mla.v_head_dim)
            )
        else:
            self.o_proj = Linear(heads * mla.v_head_dim, hidden, bias=bias)
        heads = self.num_heads
        self.backend = backend
        self.scale = qk_head_dim**-0.5
        rope = config.rope
        if rope.rope_type != "default" and rope.mscale_all_dim:  # yarn's softmax scale
            self.scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
        self.kv_b_proj.weight_shared = True  # MLAWeights reads it
        self.weights = MLAWeights(
            self.kv_b_proj.weight,
            heads,
            mla.qk_nope_head_dim,
            mla.v_head_dim,
            mla.kv_lora_rank,
            self.scale,
        )  # fmt: skip (the Parameter: a dtype change of its data shows through)

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
        out = self.backend.forward(
            q_nope, rot[:, :-1], entry, kv_cache, meta, self.weights, self.kv_b_proj
        )
        return self.o_proj(out.reshape(num_tokens, -1))


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    attention_cls = MLAttention


class DeepseekV3Model(LlamaModel):
    """Llama's stack of layers with MLA and experts; the rotary tables cover
    qk_rope_head_dim (the config's head_dim for these models)."""

    layer_cls = DeepseekV3DecoderLayer


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


class MTPDraftHead(nn.Module):
    """Speculative decoding's drafter over a model's first MTP layer (ember.engine.
    hidden_drafter): at position p it reads the next token's embedding and the model's
    final (normed) hidden state at p, and predicts the token after next; drafting on, it
    reads its own output before `shared_head.norm` (as DeepSeek-V3's MTP module chains)."""

    def __init__(self, model: DeepseekV3ForCausalLM) -> None:
        super().__init__()
        self.target = [model]  # in a list: not a submodule of the head
        self.mtp = model.mtp[0]

    def combine(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's hidden states (before the final norm) -> what the MTP layer reads."""
        return self.target[0].model.norm(hidden)

    def forward(self, input_ids, positions, kv_caches, meta, hidden):
        model, mtp, dtype = self.target[0].model, self.mtp, hidden.dtype
        embeds = F.embedding(input_ids, model.embed_tokens.weight).to(dtype)
        embeds = embeds.masked_fill((positions == 0).unsqueeze(-1), 0)  # as DeepSeek trained it
        x = mtp.eh_proj(torch.cat([mtp.enorm(embeds), mtp.hnorm(hidden)], dim=-1)).to(dtype)
        cos_sin = model.rotary_emb.cos_sin(positions, dtype)
        x, residual = mtp.layer(x, None, kv_caches[0], meta, cos_sin)
        return (x + residual).to(dtype)

    draft_ids = None  # its logits are over the model's own vocabulary

    def draft_logits(self, prenorm: torch.Tensor) -> torch.Tensor:
        return self.target[0].lm_head(self.mtp.shared_head_norm(prenorm))

    def target_ids(self, indices: torch.Tensor) -> torch.Tensor:
        return indices


# checkpoint names that are not this model's: a multimodal wrapper's vision parts, and
# the copies of the embedding and output head in multi-token-prediction layers
_OTHER_PREFIXES = ("vision_tower.", "mm_projector.", "multi_modal_projector.")
_MTP_COPIES = ("embed_tokens.", "shared_head.head.")
_MTP_OWN = ("enorm.", "hnorm.", "eh_proj.")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    model_cls = DeepseekV3Model
    fused_params = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    @staticmethod
    def kv_cache_spec(config: ModelConfig) -> KVCacheSpec:
        """One latent vector and one rotary key per token and layer, for all heads (the
        same on every tensor-parallel rank)."""
        return KVCacheSpec(1, 1, config.mla.kv_lora_rank + config.mla.qk_rope_head_dim)

    def __init__(self, config: ModelConfig, backend: AttentionBackend, max_positions: int):
        backend = MLABackend()  # MLA brings its own attention
        super().__init__(config, backend, max_positions)
        layers = config.num_hidden_layers
        self.mtp = nn.ModuleList(
            MultiTokenPredictor(config, backend, layers + k) for k in range(config.num_mtp_layers)
        )
        self._num_skipped = 0

    def _checkpoint_name(self, name: str) -> str | None:
        """Kimi K2.5's `language_model.` prefix off; MTP layers' tensors as `mtp.{k}.*`;
        vision tensors and the MTP layers' copies of the embedding and head skipped."""
        name = super()._checkpoint_name(name.removeprefix("language_model."))
        if name is None:
            return None
        match = _LAYER.match(name)
        if match is not None and int(match.group(1)) >= self.config.num_hidden_layers:
            k, rest = int(match.group(1)) - self.config.num_hidden_layers, name[match.end() :]
            if rest.startswith(_MTP_COPIES):
                name = None
            elif rest.startswith("shared_head.norm."):
                name = f"mtp.{k}.shared_head_norm.{rest.removeprefix('shared_head.norm.')}"
            else:
                name = f"mtp.{k}.{rest}" if rest.startswith(_MTP_OWN) else f"mtp.{k}.layer.{rest}"
        if name is None or name.startswith(_OTHER_PREFIXES):
            self._num_skipped += 1
            return None
        return name

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        if self._num_skipped:
            logger.info(
                "%d checkpoint tensors are not used (copies in MTP layers, vision)",
                self._num_skipped,
            )
        if self.mtp and not any(name.startswith("mtp.") for name in loaded):
            logger.info("the checkpoint has no multi-token-prediction layers")
            self.mtp = nn.ModuleList()  # transformers' save_pretrained writes none
            params = dict(self.named_parameters())
        super()._check_complete(params, loaded)

"""What a model file needs, read once from a Hugging Face config.json dict (transformers
4.x or 5.x layout): `ModelConfig` with its rotary (`RopeConfig`), latent attention
(`MLAConfig`), mixture-of-experts (`MoEConfig`) and EAGLE-3 head (`EagleConfig`) parts.
The engine's own options are `ember.config.EngineConfig`. No torch here: the API process
reads these too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn (DeepSeek-V3, Kimi K2): the ramp between interpolated and extrapolated
    # frequencies, and the magnitude scale of cos/sin (attention_factor; None: from
    # mscale / mscale_all_dim as transformers infers it)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> RopeConfig:
        params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type not in ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
            )
        original = int(params.get("original_max_position_embeddings", 8192))
        factor = params.get("factor")
        if factor is None and rope_type == "yarn":  # as transformers: the context's growth
            factor = int(cfg.get("max_position_embeddings", original)) / original
        attention_factor = params.get("attention_factor")
        return RopeConfig(
            theta=float(theta),
            rope_type=rope_type,
            factor=float(1.0 if factor is None else factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=float(params.get("mscale") or 0.0),
            mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            attention_factor=None if attention_factor is None else float(attention_factor),
            truncate=bool(params.get("truncate", True)),
        )

    @property
    def magnitude(self) -> float:
        """The factor cos and sin are scaled by (yarn's attention factor; else 1)."""
        if self.rope_type != "yarn":
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values are
    up-projections of one compressed latent per token, which is what the cache keeps,
    beside a rotary key shared by all heads."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # rotary pairs are (x0, x1), (x2, x3), ... in the weights


@dataclass(frozen=True)
class MoEConfig:
    """A mixture of experts: each token's MLP is `top_k` of `num_experts` experts (plus
    shared ones), weighted by a router."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one expert
    scoring: str  # "sigmoid" (DeepSeek-V3: with a selection bias, group-limited) | "softmax"
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    num_groups: int = 1  # experts in groups; a token picks from its topk_groups best groups
    topk_groups: int = 1
    shared_intermediate_size: int = 0  # 0: no shared expert
    dense_layers: frozenset[int] = frozenset()  # layers with a dense MLP instead

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: RopeConfig
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    # DeepSeek-V3's multi-token-prediction layers after the last decoder layer (loaded and
    # kept for speculative decoding; plain decoding does not run them)
    num_mtp_layers: int = 0
    eagle: EagleConfig | None = None  # an EAGLE-3 head's own settings

    @staticmethod
    def from_hf(cfg: dict[str, Any]) -> ModelConfig:
        cfg = _text_config(cfg)
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json names no `architectures`")
        arch = archs[0]
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        window = cfg.get("sliding_window")
        if arch.startswith("Qwen") and not cfg.get("use_sliding_window", False):
            window = None
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            # MLA: the rotary part of a head, as transformers has it
            head_dim=int(
                cfg["qk_rope_head_dim"]
                if arch in MLA_ARCHITECTURES
                else cfg.get("head_dim") or hidden // heads
            ),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            rope=RopeConfig.from_hf(cfg),
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            mla=_mla_config(cfg) if arch in MLA_ARCHITECTURES else None,
            num_mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0)
            if arch in MLA_ARCHITECTURES
            else 0,
            moe=_moe_config(arch, cfg),
            eagle=_eagle_config(cfg) if arch in EAGLE3_ARCHITECTURES else None,
        )


MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# EAGLE-3 heads: the name the EAGLE authors' and SGLang's checkpoints give, and vLLM's
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")


@dataclass(frozen=True)
class EagleConfig:
    """An EAGLE-3 head: one decoder layer over [embedding of the next token | the
    target's hidden states at `aux_layers`, fused by `fc`], with an output head over a
    draft vocabulary of its own (mapped to the target's by the checkpoint's `d2t`)."""

    draft_vocab_size: int
    target_hidden_size: int
    # the target's residual stream before these layers (None: 2, N // 2 and N - 3 of
    # a target of N layers, what EAGLE-3 was trained on by default)
    aux_layers: tuple[int, ...] | None
    norm_before_residual: bool  # the residual is the normed hidden state, not the raw one

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        return self.aux_layers or (2, num_layers // 2, num_layers - 3)


# variants of the format ember does not read (they change the head's arithmetic)
_EAGLE_UNSUPPORTED = ("norm_before_fc", "fc_norm", "norm_output")


def _eagle_config(cfg: dict[str, Any]) -> EagleConfig:
    eagle = cfg.get("eagle_config") or {}
    for key in _EAGLE_UNSUPPORTED:
        if eagle.get(key, cfg.get(key)):
            raise ValueError(f"EAGLE-3 head: {key!r} is not supported")
    if eagle.get("use_aux_hidden_state") is False:
        raise ValueError(
            "EAGLE-3 head: use_aux_hidden_state false (an EAGLE-1 head) is not supported"
        )
    layers = cfg.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    hidden = int(cfg["hidden_size"])
    return EagleConfig(
        draft_vocab_size=int(cfg.get("draft_vocab_size") or cfg["vocab_size"]),
        target_hidden_size=int(cfg.get("target_hidden_size") or hidden),
        aux_layers=tuple(int(i) for i in layers) if layers else None,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
    )


def _text_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal wrapper's language model (Kimi K2.5: a `text_config` of type
    deepseek_v3) as a config of its own; other configs as they are."""
    text = cfg.get("text_config")
    if not isinstance(text, dict) or text.get("model_type") != "deepseek_v3":
        return cfg
    merged = {k: v for k, v in cfg.items() if k in ("eos_token_id", "bos_token_id")}
    merged.update(text)
    merged["architectures"] = list(text.get("architectures") or ["DeepseekV3ForCausalLM"])
    return merged


def _mla_config(cfg: dict[str, Any]) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
    )


def _num_experts(cfg: dict[str, Any]) -> int:
    """Routed experts, under any of the names configs give them (transformers 5 writes
    num_local_experts for all; DeepSeek's own configs say n_routed_experts)."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


def _moe_config(arch: str, cfg: dict[str, Any]) -> MoEConfig | None:
    layers = range(int(cfg["num_hidden_layers"]))
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=_num_experts(cfg),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["intermediate_size"]),
            scoring="softmax",
            norm_topk_prob=True,
        )
    if arch == "Qwen3MoeForCausalLM":
        step, dense = (
            int(cfg.get("decoder_sparse_step") or 1),
            set(cfg.get("mlp_only_layers") or []),
        )
        return MoEConfig(
            num_experts=_num_experts(cfg),
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            scoring="softmax",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
            dense_layers=frozenset(i for i in layers if i in dense or (i + 1) % step),
        )
    if arch != "DeepseekV3ForCausalLM":
        return None
    num_experts = _num_experts(cfg)
    if not num_experts:
        return None
    size = int(cfg["moe_intermediate_size"])
    first_moe = int(cfg.get("first_k_dense_replace") or 0)
    return MoEConfig(
        num_experts=num_experts,
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=size,
        scoring="sigmoid",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_groups=int(cfg.get("n_group") or 1),
        topk_groups=int(cfg.get("topk_group") or 1),
        shared_intermediate_size=size * int(cfg.get("n_shared_experts") or 0),
        dense_layers=frozenset(range(first_moe)),
    )

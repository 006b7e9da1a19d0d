"""Transformers checkpoints of the MoE and MLA architectures written as GGUF files the way
llama.cpp's convert_hf_to_gguf.py writes them (tensor names from the gguf package's own
name map, experts stacked per projection, MLA's kv_b_proj split per head into attn_k_b /
attn_v_b, llama's q/k rows permuted): what the tests load and compare with transformers,
and what benchmarks/moe_mla.py quantizes."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from transformers import AutoTokenizer

QT = gguf.GGMLQuantizationType
SIGMOID = gguf.ExpertGatingFuncType.SIGMOID
GGUF_ARCH = {"deepseek_v3": "deepseek2", "qwen3_moe": "qwen3moe", "mixtral": "llama"}


def to_llama_cpp_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter order for llama q/k: per head, interleave the two row halves."""
    half = weights.shape[0] // num_heads // 2
    split = weights.reshape(num_heads, 2, half, *weights.shape[1:])
    return split.swapaxes(1, 2).reshape(weights.shape)


def write_gguf(
    model, model_type: str, path: Path, qtype: QT = QT.F32, split_kv_b: bool = True,
    per_expert: bool = False, gating: gguf.ExpertGatingFuncType | None = SIGMOID,
    tokenizer_dir: Path | None = None,
) -> Path:  # fmt: skip
    """`model` (transformers) as llama.cpp's convert_hf_to_gguf.py writes it: matrices
    whose rows split into whole blocks of `qtype` in it, the rest F32. `split_kv_b=False`:
    a deepseek2 file from before llama.cpp's MLA change (attn_kv_b, one KV head per head);
    `per_expert`: one tensor per expert (`blk.N.ffn_gate.E.weight`), as files converted
    before llama.cpp stacked them; `gating`: deepseek2's expert_gating_func (None: not
    written); `tokenizer_dir`: the checkpoint's tokenizer in the file's metadata."""
    arch = GGUF_ARCH[model_type]
    config = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    _write_metadata(writer, config, model_type, split_kv_b, gating)
    if tokenizer_dir is not None:
        _write_tokenizer(writer, tokenizer_dir)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], config.num_hidden_layers)
    dense_names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    for name, tensor in _hf_tensors(model, model_type, split_kv_b):
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        # Qwen3-MoE's dense layers (mlp_only_layers) by the names llama's map gives them
        gguf_name = gguf_name or dense_names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        data = tensor.detach().float().numpy()
        if model_type == "mixtral" and (".q_proj." in name or ".k_proj." in name):
            heads = config.num_attention_heads if ".q_proj." in name else config.num_key_value_heads
            data = to_llama_cpp_rows(data, heads)
        tensor_type = qtype if data.ndim >= 2 and _fits(data, qtype) else QT.F32
        if per_expert and gguf_name.endswith("_exps.weight"):
            for expert, one in enumerate(data):
                one_name = gguf_name.replace("_exps.weight", f".{expert}.weight")
                writer.add_tensor(
                    one_name, gguf.quants.quantize(one, tensor_type), raw_dtype=tensor_type
                )
            continue
        writer.add_tensor(gguf_name, gguf.quants.quantize(data, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _fits(data: np.ndarray, qtype: QT) -> bool:
    return data.shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0] == 0


def _hf_tensors(model, model_type: str, split_kv_b: bool):
    """(name, tensor) in the names llama.cpp's name map knows: transformers' fused experts
    as one stacked tensor per projection, kv_b_proj split per head, the router bias as
    `e_score_correction.bias`."""
    config = model.config
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name.endswith(".experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            yield name.replace("gate_up_proj", "gate_proj.weight"), gate
            yield name.replace("gate_up_proj", "up_proj.weight"), up
        elif name.endswith(".experts.down_proj"):
            yield f"{name}.weight", tensor
        elif name.endswith("e_score_correction_bias"):
            yield name.replace("e_score_correction_bias", "e_score_correction.bias"), tensor
        elif name.endswith("kv_b_proj.weight") and split_kv_b:
            heads, nope = config.num_attention_heads, config.qk_nope_head_dim
            per_head = tensor.view(heads, nope + config.v_head_dim, -1)
            k_b, v_b = per_head.split([nope, config.v_head_dim], dim=1)
            yield name.replace("kv_b_proj", "k_b_proj"), k_b.transpose(1, 2)
            yield name.replace("kv_b_proj", "v_b_proj"), v_b
        else:
            yield name, tensor


def _write_metadata(
    writer: gguf.GGUFWriter, config, model_type: str, split_kv_b: bool, gating
) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if model_type == "mixtral":
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
        writer.add_expert_count(config.num_local_experts)
        return
    if model_type == "qwen3_moe":
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
        return
    rope, kv_lora = config.qk_rope_head_dim, config.kv_lora_rank
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    if gating is not None:
        writer.add_expert_gating_func(gating)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(kv_lora)
    if split_kv_b:  # the latent as one KV head of kv_lora_rank + rope dims
        writer.add_head_count_kv(1)
        writer.add_key_length(kv_lora + rope)
        writer.add_value_length(kv_lora)
        writer.add_key_length_mla(config.qk_nope_head_dim + rope)
        writer.add_value_length_mla(config.v_head_dim)
    else:
        writer.add_head_count_kv(config.num_attention_heads)
        writer.add_key_length(config.qk_nope_head_dim + rope)
        writer.add_value_length(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    writer.add_rope_dimension_count(rope)
    params = config.rope_parameters
    if params["rope_type"] == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(params["factor"])
        writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
        if "beta_fast" in params:
            writer.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
        if "beta_slow" in params:
            writer.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
        writer.add_rope_scaling_yarn_log_mul(0.1 * params["mscale_all_dim"])


def _write_tokenizer(writer: gguf.GGUFWriter, path: Path) -> None:
    """A byte-level BPE vocabulary as llama.cpp writes one (tokenizer.ggml.model "gpt2")."""
    spec = json.loads((path / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in spec["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_merges(
        [" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]]
    )
    writer.add_chat_template(AutoTokenizer.from_pretrained(path).chat_template)
    writer.add_bos_token_id(2)
    writer.add_add_bos_token(True)

"""Read GGUF checkpoints (llama.cpp's format) as Hugging Face configs and weights (the
tokenizer: `gguf_index.gguf_tokenizer`).

Architectures: llama (also Mistral, and Mixtral: llama with `expert_count`), qwen2,
qwen3, qwen3moe, and deepseek2 (DeepSeek-V3/R1, Kimi K2: read as DeepseekV3ForCausalLM).

Shapes: GGUF records a matrix's dims innermost first, so a Linear of Hugging Face shape
[out, in] is stored with `tensor.shape == [in, out]`. `GGUFReader` already exposes its
data row-major as [out, in] (float types) or [out, bytes_per_row] (quantized types),
and `gguf.quants.dequantize` turns either into float32 [out, in]: the HF layout.

Rope: for arch "llama", llama.cpp's converter reorders the rows of attn_q and attn_k
within each head so that interleaved-pair rope (GPT-J style) gives the same result as
Hugging Face's rotate-half. `iter_gguf_weights` undoes that. qwen2/qwen3/qwen3moe files
keep HF's row order (llama.cpp runs them with NeoX rope); so do deepseek2 files, whose
rotary pairs are interleaved in the original weights (transformers' `rope_interleave`).

Experts: llama.cpp stacks each layer's routed experts into one tensor per projection
(`ffn_gate_exps`, HF shape [experts, out, in]); they are yielded expert by expert under
the per-expert names published checkpoints use (`mlp.experts.{e}.gate_proj.weight`),
dequantized one expert at a time. Files from before that (early 2024) name each expert
`ffn_gate.{e}`.

MLA (deepseek2): llama.cpp's converter splits `kv_b_proj` per head into `attn_k_b`
(the key part, transposed: [heads, kv_lora_rank, qk_nope]) and `attn_v_b` ([heads,
v_head_dim, kv_lora_rank]) and writes the latent as one KV head (`head_count_kv` 1,
`key_length` kv_lora_rank + rope dims, the per-head sizes in `key_length_mla` /
`value_length_mla`); the two are joined back into `kv_b_proj`. Files from before that
change hold `attn_kv_b` as it is, with per-head sizes in `key_length` / `value_length`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ember.distributed.parallel import SKIP
from ember.loader.dequant import BLOCK_FORMATS, dequantize
from ember.loader.gguf_index import GGUFIndex
from ember.loader.gguf_index import tensors as indexed_tensors

logger = logging.getLogger("ember.loader")

_ARCHITECTURES = {
    # also Mistral files (llama.cpp converts them as "llama") and, with experts, Mixtral
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "deepseek2": "DeepseekV3ForCausalLM",
}
_MODEL_TYPES = {"qwen3moe": "qwen3_moe", "deepseek2": "deepseek_v3"}

_QT = gguf.GGMLQuantizationType
# The types gguf 0.19's `gguf.quants.dequantize` implements.
_DEQUANTIZABLE = frozenset({
    _QT.F32, _QT.F16, _QT.BF16,
    _QT.Q4_0, _QT.Q4_1, _QT.Q5_0, _QT.Q5_1, _QT.Q8_0,
    _QT.Q2_K, _QT.Q3_K, _QT.Q4_K, _QT.Q5_K, _QT.Q6_K,
    _QT.IQ1_S, _QT.IQ1_M, _QT.IQ2_XXS, _QT.IQ2_XS, _QT.IQ2_S, _QT.IQ3_XXS, _QT.IQ3_S,
    _QT.IQ4_NL, _QT.IQ4_XS, _QT.TQ1_0, _QT.TQ2_0, _QT.MXFP4,
})  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture of experts
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    # multi-head latent attention
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# the selection bias of DeepSeek-V3's router (e_score_correction_bias)
_ROUTER_BIAS = re.compile(r"blk\.(\d+)\.exp_probs_b\.(?:bias|weight)")
# all experts of a layer stacked: [experts, out, in] in HF order
_STACKED_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
# one expert (files converted before llama.cpp stacked them)
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")
# MLA's kv_b_proj split in two: attn_k_b [heads, kv_lora_rank, qk_nope], attn_v_b
_KV_B_PART = re.compile(r"blk\.(\d+)\.attn_([kv])_b\.weight")
_SKIPPED = frozenset({"rope_freqs.weight"})
# the part (dim, start, length) of a tensor (by Hugging Face name) that is wanted; None: all
Narrow = Callable[[str], "tuple[int, int, int] | None"]


def read_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file memory-mapped; a missing, corrupt or truncated file raises ValueError."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"GGUF file not found: {path}")
    try:
        reader = gguf.GGUFReader(path)
    # The parser indexes raw bytes, so damage surfaces as any of many exception types.
    except Exception as exc:
        raise ValueError(f"not a readable GGUF file: {path} ({type(exc).__name__}: {exc})") from exc
    _check_tensor_bounds(reader, path)
    return reader


def _check_tensor_bounds(reader: gguf.GGUFReader, path: Path) -> None:
    file_size = len(reader.data)
    for tensor in reader.tensors:
        end = tensor.data_offset + tensor.n_bytes
        if end > file_size:
            raise ValueError(
                f"truncated GGUF file: {path}: tensor {tensor.name} ends at byte {end} "
                f"but the file has {file_size} bytes"
            )


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _required(reader: gguf.GGUFReader, key: str) -> Any:
    value = _field(reader, key)
    if value is None:
        raise ValueError(f"GGUF metadata lacks {key!r}")
    return value


def _float32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (1e-05, not 9.999999747378752e-06)."""
    return float(str(np.float32(value)))


def _architecture(reader: gguf.GGUFReader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; supported: {', '.join(_ARCHITECTURES)}"
        )
    return arch


def gguf_to_hf_config(reader: gguf.GGUFReader) -> dict[str, Any]:
    """A Hugging Face config.json-style dict for a GGUF file of one of _ARCHITECTURES."""
    arch = _architecture(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            "llama3-style rope scaling (rope_freqs.weight) is unsupported for GGUF for now"
        )
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    config = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": _MODEL_TYPES.get(arch, arch),
        "vocab_size": _num_rows(tensors, "token_embd.weight"),
        "hidden_size": int(_required(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(
            _field(reader, f"{arch}.feed_forward_length")
            or _required(reader, f"{arch}.expert_feed_forward_length")
        ),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "rms_norm_eps": _float32(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_required(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "rope_scaling": _rope_scaling(reader, arch),
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
    }
    if arch == "deepseek2":
        config.update(_deepseek2_config(reader, tensors, num_heads))
    else:
        config["head_dim"] = _head_dim(reader, arch, tensors, num_heads)
        config.update(_experts_config(reader, arch, tensors))
    return config


def _experts_config(reader: gguf.GGUFReader, arch: str, tensors: dict[str, Any]) -> dict:
    """Mixtral (llama with experts) and Qwen3-MoE. llama.cpp always renormalizes their top-k
    weights (`expert_weights_norm` is not written for them)."""
    num_experts = int(_field(reader, f"{arch}.expert_count") or 0)
    if not num_experts:
        if arch == "qwen3moe":
            raise ValueError("GGUF metadata lacks 'qwen3moe.expert_count'")
        return {}
    top_k = int(_required(reader, f"{arch}.expert_used_count"))
    if arch == "llama":
        return {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "num_local_experts": num_experts,
            "num_experts_per_tok": top_k,
            "sliding_window": None,
        }
    layers = int(_required(reader, f"{arch}.block_count"))
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(_required(reader, f"{arch}.expert_feed_forward_length")),
        "norm_topk_prob": bool(_field(reader, f"{arch}.expert_weights_norm", True)),
        "decoder_sparse_step": 1,
        # a layer with a dense MLP has no router
        "mlp_only_layers": [
            i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensors
        ],
    }


_SIGMOID_GATING = int(gguf.ExpertGatingFuncType.SIGMOID)


def _deepseek2_config(reader: gguf.GGUFReader, tensors: dict[str, Any], num_heads: int) -> dict:
    """DeepSeek-V3's config from a deepseek2 file (see the module's note on MLA)."""
    arch = "deepseek2"
    rope_dims = int(_required(reader, f"{arch}.rope.dimension_count"))
    key_length_mla = _field(reader, f"{arch}.attention.key_length_mla")
    if key_length_mla is not None:
        qk_head_dim = int(key_length_mla)
        v_head_dim = int(_required(reader, f"{arch}.attention.value_length_mla"))
    else:
        qk_head_dim = int(_required(reader, f"{arch}.attention.key_length"))
        v_head_dim = int(_required(reader, f"{arch}.attention.value_length"))
    q_lora_rank = None  # q in one projection (attn_q), or through a LoRA (attn_q_a, attn_q_b)
    if "blk.0.attn_q_a.weight" in tensors:
        q_lora_rank = int(_required(reader, f"{arch}.attention.q_lora_rank"))
    config = {
        "num_key_value_heads": num_heads,  # MLA: every head reads the one latent
        "head_dim": rope_dims,
        "q_lora_rank": q_lora_rank,
        "kv_lora_rank": int(_required(reader, f"{arch}.attention.kv_lora_rank")),
        "qk_nope_head_dim": qk_head_dim - rope_dims,
        "qk_rope_head_dim": rope_dims,
        "v_head_dim": v_head_dim,
        "rope_interleave": True,  # llama.cpp rotates deepseek2's pairs as they are stored
        "first_k_dense_replace": int(_field(reader, f"{arch}.leading_dense_block_count", 0)),
        "num_nextn_predict_layers": 0,  # llama.cpp's converter leaves the MTP layers out
    }
    num_experts = int(_field(reader, f"{arch}.expert_count") or 0)
    if not num_experts:
        return config
    gating = _field(reader, f"{arch}.expert_gating_func")
    if gating != _SIGMOID_GATING:  # absent: softmax, as llama.cpp reads DeepSeek-V2 files
        raise ValueError(
            "deepseek2 GGUF files with softmax expert gating (DeepSeek-V2) are unsupported; "
            "DeepSeek-V3/R1 and Kimi K2 files (sigmoid gating) are"
        )
    moe_size = int(_required(reader, f"{arch}.expert_feed_forward_length"))
    config.update(
        n_routed_experts=num_experts,
        num_experts_per_tok=int(_required(reader, f"{arch}.expert_used_count")),
        moe_intermediate_size=moe_size,
        n_shared_experts=int(_field(reader, f"{arch}.expert_shared_count", 0)),
        routed_scaling_factor=_float32(_field(reader, f"{arch}.expert_weights_scale", 1.0)),
        norm_topk_prob=bool(_field(reader, f"{arch}.expert_weights_norm", False)),
        n_group=int(_field(reader, f"{arch}.expert_group_count", 1)),
        topk_group=int(_field(reader, f"{arch}.expert_group_used_count", 1)),
        scoring_func="sigmoid",
    )
    return config


def _num_rows(tensors: dict[str, Any], name: str) -> int:
    """Rows of a GGUF matrix in HF layout: its outermost (last-listed) GGUF dim."""
    if name not in tensors:
        raise ValueError(f"GGUF file lacks tensor {name}")
    return int(tensors[name].shape[-1])


def _head_dim(reader: gguf.GGUFReader, arch: str, tensors: dict[str, Any], num_heads: int) -> int:
    """`attention.key_length` when written (qwen3's head_dim != hidden / heads), else q's rows / heads."""
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length is not None:
        return int(key_length)
    return _num_rows(tensors, "blk.0.attn_q.weight") // num_heads


def _rope_scaling(reader: gguf.GGUFReader, arch: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    if kind is None and (legacy := _field(reader, f"{arch}.rope.scale_linear")) is not None:
        kind, factor = "linear", legacy
    if kind in (None, "none") or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _float32(factor)}
    if kind != "yarn":
        raise ValueError(f"rope scaling type {kind!r} is unsupported for GGUF for now")
    if _field(reader, f"{arch}.rope.scaling.yarn_attn_factor") is not None:
        raise ValueError("yarn rope scaling with an attention factor is unsupported for GGUF")
    scaling = {
        "rope_type": "yarn",
        "factor": _float32(_required(reader, f"{arch}.rope.scaling.factor")),
        "original_max_position_embeddings": int(
            _required(reader, f"{arch}.rope.scaling.original_context_length")
        ),
        "beta_fast": _float32(_field(reader, f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": _float32(_field(reader, f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
    }
    log_multiplier = _field(reader, f"{arch}.rope.scaling.yarn_log_multiplier")
    if arch == "deepseek2" and log_multiplier:
        # llama.cpp's deepseek2 files keep 0.1 x mscale_all_dim (and assume mscale equal
        # to it: cos and sin unscaled, the softmax scale times yarn's mscale squared)
        mscale = round(10 * _float32(log_multiplier), 6)
        scaling.update(mscale=mscale, mscale_all_dim=mscale)
    return scaling


def iter_gguf_weights(
    reader: gguf.GGUFReader, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor in HF shape) for every tensor, one at a time."""
    yield from _iter_weights(reader.tensors, _architecture(reader), config)


def iter_indexed_weights(
    path: Path, index: GGUFIndex, config: dict[str, Any], narrow: Narrow | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """The same, for a file opened through its cached index (no metadata parse); with
    `narrow`, of each matrix only the part it names (see Checkpoint.weights)."""
    tensors = indexed_tensors(path, index)
    yield from _iter_weights(tensors, index.architecture, config, narrow)


def iter_indexed_blocks(
    path: Path,
    index: GGUFIndex,
    config: dict[str, Any],
    narrow: Narrow | None = None,
    shapes_only: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, uint8 [out_features, blocks per row, bytes per block]) for every
    matrix stored in one of BLOCK_FORMATS: its raw blocks, copied out of the file, rows in
    HF order; stacked experts one expert at a time, under per-expert names. With `narrow`,
    only the part of each matrix it names (nothing where that part's columns do not fall
    on block boundaries). `shapes_only`: the same tensors on the meta device, nothing read
    (what loading them would hold)."""
    interleaved_rope = index.architecture == "llama"
    for tensor in indexed_tensors(path, index):
        if tensor.tensor_type not in BLOCK_FORMATS:
            continue
        _, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        num_columns = int(tensor.shape[0])
        rows_of = _block_shape if shapes_only else _block_rows
        if match := _STACKED_EXPERTS.fullmatch(tensor.name):  # expert by expert
            layer, part = match.groups()
            for expert in range(tensor.data.shape[0]):
                name = _expert_name(layer, expert, part)
                piece = narrow(name) if narrow is not None else None
                rows = rows_of(tensor.data[expert], piece, type_size, num_columns)
                if rows is not None:
                    yield name, _as_tensor(rows)
            continue
        if len(tensor.shape) != 2:
            continue
        name = _hf_name(tensor.name)
        piece = narrow(name) if narrow is not None else None
        rows = rows_of(tensor.data, piece, type_size, num_columns)
        if rows is None:
            continue
        if interleaved_rope and not shapes_only:  # a permutation of rows: the same shape
            rows = _undo_rope_permutation(tensor.name, rows, config, tensor.data.shape[0])
        yield name, _as_tensor(rows)


def _as_tensor(rows: np.ndarray | tuple[int, ...]) -> torch.Tensor:
    """Blocks read (an array), or their shape alone (a meta tensor)."""
    if isinstance(rows, tuple):
        return torch.empty(rows, dtype=torch.uint8, device="meta")
    return torch.from_numpy(rows)


def _block_rows(data: np.ndarray, piece, type_size: int, num_columns: int) -> np.ndarray | None:
    """uint8 [rows, blocks per row, bytes per block] of a matrix's raw `data`, or of the
    part `piece` names (dim, start, length); None for SKIP, or columns that do not fall
    on block boundaries."""
    shape = _block_shape(data, piece, type_size, num_columns)
    if shape is None:
        return None
    if piece is not None and piece[0] == 0:
        data = data[piece[1] : piece[1] + piece[2]]
    rows = np.array(data, dtype=np.uint8)  # a row's blocks move as a whole
    rows = rows.reshape(rows.shape[0], -1, type_size)
    if piece is not None and piece[0] == 1:
        start, length = piece[1] // (num_columns // rows.shape[1]), shape[1]
        rows = np.ascontiguousarray(rows[:, start : start + length])
    return rows


def _block_shape(
    data: np.ndarray, piece, type_size: int, num_columns: int
) -> tuple[int, ...] | None:
    """The shape _block_rows gives (None where it gives None), from `data`'s shape alone."""
    if piece == SKIP:
        return None
    num_rows, blocks = data.shape[0], data.shape[1] // type_size
    if piece is not None and piece[0] == 0:
        num_rows = len(range(num_rows)[piece[1] : piece[1] + piece[2]])
    if piece is not None and piece[0] == 1:
        per_block = num_columns // blocks  # weights per block
        _, start, length = piece
        if start % per_block or length % per_block:
            return None
        blocks = length // per_block
    return (num_rows, blocks, type_size)


def _iter_weights(
    tensors: list, architecture: str, config: dict[str, Any], narrow: Narrow | None = None
):
    unsupported = [t for t in tensors if t.tensor_type not in _DEQUANTIZABLE]
    if unsupported:
        tensor = unsupported[0]
        raise ValueError(
            f"tensor {tensor.name} has GGML type {tensor.tensor_type.name}, which cannot be "
            f"dequantized ({len(unsupported)} such tensors)"
        )
    interleaved_rope = architecture == "llama"
    kv_b_parts: dict[str, dict[str, np.ndarray]] = {}  # layer -> "k" / "v" -> weights
    for tensor in tensors:
        name = tensor.name
        if name in _SKIPPED:
            continue
        if match := _STACKED_EXPERTS.fullmatch(name):
            layer, part = match.groups()
            for expert in range(tensor.data.shape[0]):  # one expert's floats at a time
                name = _expert_name(layer, expert, part)
                piece = narrow(name) if narrow is not None else None
                if piece == SKIP:  # another rank's expert
                    yield name, torch.empty(0)
                    continue
                data = tensor.data[expert]
                if piece is not None and piece[0] == 0:  # the rank's rows only
                    data = data[piece[1] : piece[1] + piece[2]]
                weights = _dequantize(tensor, data)
                if piece is not None and piece[0] == 1:  # its columns
                    weights = np.ascontiguousarray(weights[:, piece[1] : piece[1] + piece[2]])
                yield name, torch.from_numpy(weights)
            continue
        part = None
        if narrow is not None and not _KV_B_PART.fullmatch(name):
            part = narrow(_hf_name(name))
            if part == SKIP:  # another rank's expert
                yield _hf_name(name), torch.empty(0)
                continue
        weights = _dequantize(tensor) if part is None else _dequantize_part(tensor, part)
        if match := _KV_B_PART.fullmatch(name):
            layer, part = match.groups()
            parts = kv_b_parts.setdefault(layer, {})
            parts[part] = weights
            if len(parts) == 2:
                del kv_b_parts[layer]
                yield f"model.layers.{layer}.self_attn.kv_b_proj.weight", _join_kv_b(**parts)
            continue
        if interleaved_rope:
            weights = _undo_rope_permutation(name, weights, config, tensor.data.shape[0])
        yield _hf_name(name), torch.from_numpy(weights)
    if kv_b_parts:
        layer, parts = next(iter(kv_b_parts.items()))
        raise ValueError(f"GGUF file has blk.{layer}.attn_{next(iter(parts))}_b but not its pair")


def _expert_name(layer: str, expert: int, part: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{part}_proj.weight"


def _join_kv_b(k: np.ndarray, v: np.ndarray) -> torch.Tensor:
    """kv_b_proj [heads x (qk_nope + v_head_dim), kv_lora_rank] from attn_k_b [heads,
    kv_lora_rank, qk_nope] and attn_v_b [heads, v_head_dim, kv_lora_rank]."""
    if k.ndim != 3 or v.ndim != 3 or k.shape[:2] != (v.shape[0], v.shape[2]):
        raise ValueError(f"attn_k_b {k.shape} and attn_v_b {v.shape} do not fit together")
    joined = np.concatenate([k.transpose(0, 2, 1), v], axis=1)
    return torch.from_numpy(joined.reshape(-1, k.shape[1]))


def _hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor name (not a stacked-experts or
    attn_k_b / attn_v_b tensor: those become several, or one of two)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    if match := _ROUTER_BIAS.fullmatch(gguf_name):
        return f"model.layers.{match[1]}.mlp.gate.e_score_correction_bias"
    if match := _ONE_EXPERT.fullmatch(gguf_name):
        return _expert_name(match[1], int(match[3]), match[2])
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def _dequantize(tensor: Any, data: np.ndarray | None = None) -> np.ndarray:
    """float32 values of `tensor` (or of `data`, one expert of stacked experts, or rows of
    one) in HF shape."""
    if data is None:
        data, hf_shape = tensor.data, tuple(reversed(tensor.shape.tolist()))
    else:
        hf_shape = (-1, *tuple(reversed(tensor.shape.tolist()))[2:])
    weights = dequantize(data, tensor.tensor_type).reshape(hf_shape)
    # F32 comes back as a read-only view of the mmap: copy it so torch owns writable memory.
    return np.require(weights, dtype=np.float32, requirements=["C", "W"])


def _dequantize_part(tensor: Any, part: tuple[int, int, int]) -> np.ndarray:
    """float32 values of part (dim, start, length) of a matrix or vector in HF shape,
    dequantizing only its rows (dim 0) or DEQUANT_ROWS rows at a time (dim 1)."""
    dim, start, length = part
    hf_shape = tuple(reversed(tensor.shape.tolist()))
    if dim == 0:
        data = tensor.data[start : start + length]
        weights = dequantize(data, tensor.tensor_type).reshape(length, *hf_shape[1:])
        return np.require(weights, dtype=np.float32, requirements=["C", "W"])
    out = np.empty((hf_shape[0], length), dtype=np.float32)
    for first in range(0, hf_shape[0], DEQUANT_ROWS):
        data = tensor.data[first : first + DEQUANT_ROWS]
        rows = dequantize(data, tensor.tensor_type).reshape(-1, hf_shape[1])
        out[first : first + rows.shape[0]] = rows[:, start : start + length]
    return out


DEQUANT_ROWS = 256  # a rank's part of a matrix split by columns: the rows read at a time


def _undo_rope_permutation(
    name: str, weights: np.ndarray, config: dict[str, Any], num_rows: int | None = None
) -> np.ndarray:
    """`weights`: rows of whole heads of a tensor of `num_rows` rows (all of them if None)."""
    share = weights.shape[0] / (num_rows or weights.shape[0])  # a rank's heads of a split one
    if ".attn_q." in name:
        return _unpermute_rows(weights, round(config["num_attention_heads"] * share), name)
    if ".attn_k." in name:
        return _unpermute_rows(weights, round(config["num_key_value_heads"] * share), name)
    return weights


def _unpermute_rows(weights: np.ndarray, num_heads: int, name: str) -> np.ndarray:
    """Per head of d rows, GGUF row 2*i + j holds HF row j*(d/2) + i (biases alike).

    GGUF head rows:  h0 h(d/2) h1 h(d/2+1) ... h(d/2-1) h(d-1)
    HF head rows:    h0 h1 ... h(d/2-1) | h(d/2) ... h(d-1)
    """
    num_rows = weights.shape[0]
    if num_rows % (2 * num_heads):
        raise ValueError(f"tensor {name}: {num_rows} rows do not split into {num_heads} heads")
    half = num_rows // num_heads // 2
    split = weights.reshape(num_heads, half, 2, *weights.shape[1:])
    return np.ascontiguousarray(split.swapaxes(1, 2).reshape(weights.shape))

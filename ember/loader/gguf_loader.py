"""Read GGUF checkpoints (llama.cpp's format) as Hugging Face configs and weights (the
tokenizer: `gguf_index.gguf_tokenizer`).

Shapes: GGUF records a matrix's dims innermost first, so a Linear of Hugging Face shape
[out, in] is stored with `tensor.shape == [in, out]`. `GGUFReader` already exposes its
data row-major as [out, in] (float types) or [out, bytes_per_row] (quantized types),
and `gguf.quants.dequantize` turns either into float32 [out, in]: the HF layout.

Rope: for arch "llama", llama.cpp's converter reorders the rows of attn_q and attn_k
within each head so that interleaved-pair rope (GPT-J style) gives the same result as
Hugging Face's rotate-half. `iter_gguf_weights` undoes that. qwen2/qwen3 files keep HF's
row order (llama.cpp runs them with NeoX rope).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from ember.loader.dequant import dequantize
from ember.loader.gguf_index import GGUFIndex
from ember.loader.gguf_index import tensors as indexed_tensors

logger = logging.getLogger("ember.loader")

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",  # also Mistral files: llama.cpp converts them as "llama"
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

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
}
_BLOCK_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_SKIPPED = frozenset({"rope_freqs.weight"})


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
    """A Hugging Face config.json-style dict for a llama, qwen2 or qwen3 GGUF file."""
    arch = _architecture(reader)
    tensors = {tensor.name: tensor for tensor in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            "llama3-style rope scaling (rope_freqs.weight) is unsupported for GGUF for now"
        )
    num_heads = int(_required(reader, f"{arch}.attention.head_count"))
    return {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": _num_rows(tensors, "token_embd.weight"),
        "hidden_size": int(_required(reader, f"{arch}.embedding_length")),
        "intermediate_size": int(_required(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_required(reader, f"{arch}.block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": _head_dim(reader, arch, tensors, num_heads),
        "rms_norm_eps": _float32(_required(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(_required(reader, f"{arch}.context_length")),
        "tie_word_embeddings": "output.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "rope_scaling": _rope_scaling(reader, arch),
        "attention_bias": arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
    }


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
    if kind != "linear":
        raise ValueError(f"rope scaling type {kind!r} is unsupported for GGUF for now")
    return {"rope_type": "linear", "factor": _float32(factor)}


def iter_gguf_weights(
    reader: gguf.GGUFReader, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, float32 tensor in HF shape) for every tensor, one at a time."""
    yield from _iter_weights(reader.tensors, _architecture(reader), config)


def iter_indexed_weights(
    path: Path, index: GGUFIndex, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The same, for a file opened through its cached index (no metadata parse)."""
    yield from _iter_weights(indexed_tensors(path, index), index.architecture, config)


# The block formats ember's block GEMM decodes to exactly the fp32 weights loaded above
# (each is told apart by its bytes per block: ember/engine/kernels/block_gemm.cpp).
BLOCK_FORMATS = frozenset({
    _QT.Q4_0, _QT.Q4_1, _QT.Q5_0, _QT.Q5_1, _QT.Q8_0,  # 32 weights per block
    _QT.Q4_K, _QT.Q5_K, _QT.Q6_K,  # 256 weights per super-block
})  # fmt: skip


def iter_indexed_blocks(
    path: Path, index: GGUFIndex, config: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, uint8 [out_features, blocks per row, bytes per block]) for every
    matrix stored in one of BLOCK_FORMATS: its raw blocks, copied out of the file, rows in
    HF order."""
    interleaved_rope = index.architecture == "llama"
    for tensor in indexed_tensors(path, index):
        if tensor.tensor_type not in BLOCK_FORMATS or len(tensor.shape) != 2:
            continue
        _, type_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        rows = np.array(tensor.data, dtype=np.uint8)  # a row's blocks move as a whole
        rows = rows.reshape(rows.shape[0], -1, type_size)
        if interleaved_rope:
            rows = _undo_rope_permutation(tensor.name, rows, config)
        yield _hf_name(tensor.name), torch.from_numpy(rows)


def _iter_weights(tensors: list, architecture: str, config: dict[str, Any]):
    unsupported = [t for t in tensors if t.tensor_type not in _DEQUANTIZABLE]
    if unsupported:
        tensor = unsupported[0]
        raise ValueError(
            f"tensor {tensor.name} has GGML type {tensor.tensor_type.name}, which cannot be "
            f"dequantized ({len(unsupported)} such tensors)"
        )
    interleaved_rope = architecture == "llama"
    for tensor in tensors:
        if tensor.name in _SKIPPED:
            continue
        weights = _dequantize(tensor)
        if interleaved_rope:
            weights = _undo_rope_permutation(tensor.name, weights, config)
        yield _hf_name(tensor.name), torch.from_numpy(weights)


def _hf_name(gguf_name: str) -> str:
    """The Hugging Face parameter name of a llama/qwen GGUF tensor name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_TENSOR.fullmatch(gguf_name)
    if match is None or match[2] not in _BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def _dequantize(tensor: Any) -> np.ndarray:
    hf_shape = tuple(reversed(tensor.shape.tolist()))
    weights = dequantize(tensor.data, tensor.tensor_type).reshape(hf_shape)
    # F32 comes back as a read-only view of the mmap: copy it so torch owns writable memory.
    return np.require(weights, dtype=np.float32, requirements=["C", "W"])


def _undo_rope_permutation(name: str, weights: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    if ".attn_q." in name:
        return _unpermute_rows(weights, config["num_attention_heads"], name)
    if ".attn_k." in name:
        return _unpermute_rows(weights, config["num_key_value_heads"], name)
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

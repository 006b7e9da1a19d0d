"""A small numpy quantizer for the K-quant formats Q4_K, Q5_K and Q6_K, which gguf-py 0.19
can dequantize but not quantize: enough to write valid K-quant GGUF files in tests.

Simple per-sub-block scales (min/max for Q4_K and Q5_K, max |w| for Q6_K), not
llama.cpp's searched ones. ggml's layouts (one super-block = 256 weights):

    Q4_K  144 bytes  d, dmin (fp16) | 12 bytes: 8 x 6-bit sc, mn | 128 bytes of nibbles
          w = d * sc * q - dmin * mn, 8 sub-blocks of 32; group pair i: bytes 32i..32i+31,
          sub-block 2i in the low nibbles, 2i+1 in the high ones
    Q5_K  176 bytes  Q4_K's, with 32 bytes qh after the scales: bit g of qh[l] is the
          fifth bit of sub-block g's weight l
    Q6_K  210 bytes  128 bytes low nibbles | 64 bytes top 2 bits | 16 int8 sc | d (fp16)
          w = d * sc * (q - 32), 16 sub-blocks of 16; per half h of 128 weights, quarter t
          (32 weights) sits in nibble t // 2 of low bytes 64h + 32 (t % 2) and in bits
          2t, 2t+1 of high bytes 32h
"""

from __future__ import annotations

import gguf
import numpy as np

QT = gguf.GGMLQuantizationType
SUPER_BLOCK = 256


def quantize(weights: np.ndarray, qtype: QT) -> np.ndarray:
    """`gguf.quants.quantize`, with Q4_K, Q5_K and Q6_K added: rows of blocks, uint8."""
    if qtype in (QT.Q4_K, QT.Q5_K):
        return _rows(weights, _q45_k(_super_blocks(weights), 4 if qtype == QT.Q4_K else 5))
    if qtype == QT.Q6_K:
        return _rows(weights, _q6_k(_super_blocks(weights)))
    return gguf.quants.quantize(weights, qtype)


def _super_blocks(weights: np.ndarray) -> np.ndarray:
    if weights.shape[-1] % SUPER_BLOCK:
        raise ValueError(f"rows of {weights.shape[-1]} weights are not whole super-blocks")
    return weights.astype(np.float32).reshape(-1, SUPER_BLOCK)


def _rows(weights: np.ndarray, blocks: np.ndarray) -> np.ndarray:
    return blocks.reshape(*weights.shape[:-1], -1)


def _fp16_step(largest: np.ndarray, levels: int) -> np.ndarray:
    """A super-block's fp16 step so that `levels` of it reach `largest` (>= 0)."""
    return (largest / levels).astype(np.float16)


def _codes(values: np.ndarray, step: np.ndarray, low: int, high: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        codes = np.where(step > 0, np.round(values / step), 0)
    return np.clip(codes, low, high).astype(np.int32)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    levels = (1 << bits) - 1
    sub = x.reshape(-1, 8, 32)
    low = np.minimum(sub.min(-1), 0)  # w >= -dmin * mn >= low: mn covers the minimum
    scale, minimum = (sub.max(-1) - low) / levels, -low
    d, dmin = _fp16_step(scale.max(-1), 63), _fp16_step(minimum.max(-1), 63)
    sc = _codes(scale, d.astype(np.float32)[:, None], 0, 63)
    mn = _codes(minimum, dmin.astype(np.float32)[:, None], 0, 63)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    offset = (dmin.astype(np.float32)[:, None] * mn)[..., None]
    q = _codes(sub + offset, step, 0, levels)
    fifth = (q >> 4) << np.arange(8)[:, None]  # [block, sub-block g, l]: bit g
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    scales = np.concatenate(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4),
        ],
        axis=1,
    )
    parts = [_bytes(d), _bytes(dmin), scales.astype(np.uint8)]
    if bits == 5:
        parts.append(fifth.sum(1).astype(np.uint8))
    return np.concatenate([*parts, qs.astype(np.uint8)], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    sub = x.reshape(-1, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = _fp16_step(scale.max(-1), 127)
    sc = _codes(scale, d.astype(np.float32)[:, None], 0, 127)
    step = (d.astype(np.float32)[:, None] * sc)[..., None]
    q = (_codes(sub, step, -32, 31) + 32).reshape(-1, 2, 4, 32)  # [block, half, quarter, l]
    low, top = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], 2)
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)
    return np.concatenate(
        [
            ql.reshape(-1, 128).astype(np.uint8),
            qh.reshape(-1, 64).astype(np.uint8),
            sc.astype(np.int8).view(np.uint8),
            _bytes(d),
        ],
        axis=1,
    )


def _bytes(halves: np.ndarray) -> np.ndarray:
    return halves.reshape(-1, 1).view(np.uint8)


def use_more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's Q4_K_M rule for which layers' ffn_down get Q6_K (the rest Q4_K)."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


def q4_k_m_type(name: str, num_cols: int, num_layers: int) -> QT | None:
    """The type a Q4_K_M-style file gives matrix `name` (GGUF name, `num_cols` weights a
    row), or None to keep it: K-quants where rows are whole super-blocks (Q6_K for
    ffn_down on use_more_bits layers), Q5_0 (llama.cpp's fallback) where they are not;
    the embedding table is kept."""
    if name == "token_embd.weight":
        return None
    if num_cols % SUPER_BLOCK:
        return QT.Q5_0
    if name == "output.weight":
        return QT.Q6_K
    if name.endswith("ffn_down.weight") and use_more_bits(int(name.split(".")[1]), num_layers):
        return QT.Q6_K
    return QT.Q4_K


def requantize_q4_k_m(source: str, target: str) -> dict[QT, int]:
    """Writes GGUF file `source` to `target` with its matrices requantized as q4_k_m_type
    says (metadata, tokenizer and other tensors copied); returns matrices per type."""
    from ember.loader.dequant import dequantize

    reader = gguf.GGUFReader(source)
    arch = reader.get_field("general.architecture").contents()
    num_layers = reader.get_field(f"{arch}.block_count").contents()
    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":
            value = gguf.LlamaFileType.MOSTLY_Q4_K_M
        writer.add_key_value(field.name, value, field.types[0], sub_type)
    counts: dict[QT, int] = {}
    for tensor in reader.tensors:
        qtype = q4_k_m_type(tensor.name, int(tensor.shape[0]), num_layers)
        if len(tensor.shape) != 2 or qtype is None:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        weights = dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, quantize(weights, qtype), raw_dtype=qtype)
        counts[qtype] = counts.get(qtype, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts

"""What a CPU engine's matmuls multiply in, resolved once at load from EngineConfig
(matmul_precision, decode_activations) and what the CPU was measured to run fastest.

ModelRunner asks `prefill_precision` before any weight is read (a refusal costs no
load) and `int8_decode` before packing; the model's Linears then take the choice
(layers.use_int8_activations, pack_for_cpu's bf16_prefill).
"""

from __future__ import annotations

import logging

from ember.config import EngineConfig
from ember.engine.kernels import cpu_kernels
from ember.models.layers import (
    cpu_bf16_outruns_fp32,
    cpu_has_amx,
    cpu_has_bf16,
    cpu_int8_outruns_fp32,
)

logger = logging.getLogger("ember.engine")

# auto takes int8 for a checkpoint with at least this share of its matrix weights in
# blocks the tiles take (SmolLM2's Q4_1 file: all of them; a file mostly in K-quants: less)
TILED_SHARE_FOR_INT8 = 0.5


def prefill_precision(config: EngineConfig, tiled_share: float = 0.0) -> str:
    """What CPU steps of BF16_MIN_ROWS+ tokens (prefill chunks, large decode batches)
    multiply in: "fp32" (matmul_precision ieee), "bf16" (refused on a CPU without bf16
    units) or "int8" (GGUF blocks that tile take every row count on their int8 tiles;
    other matmuls stay fp32); auto picks what was measured fastest on such a CPU for a
    checkpoint with `tiled_share` of its matrix weights in such blocks
    (Checkpoint.tiled_share)."""
    precision = config.matmul_precision
    if precision == "ieee":
        return "fp32"
    if precision == "bf16" and not cpu_has_bf16():
        raise ValueError(
            "matmul_precision 'bf16' needs a CPU with AMX or AVX-512 BF16, and this one "
            "has neither (oneDNN would emulate bf16, slower than fp32); use 'ieee' or 'auto'"
        )
    if precision == "int8" and config.decode_activations == "fp32":
        raise ValueError(
            "matmul_precision 'int8' multiplies every row on int8 activations, which "
            "decode_activations 'fp32' refuses; set one of them otherwise"
        )
    if precision != "auto":
        logger.info("matmul_precision %s: steps of 16+ tokens run in %s", precision, precision)
        return precision
    choice, why = _auto(config, tiled_share)
    logger.info("matmul_precision auto: %s", why)
    return choice


def _auto(config: EngineConfig, tiled_share: float) -> tuple[str, str]:
    """matmul_precision auto, by what was measured on each kind of CPU
    (docs/benchmarks.md): bf16 on AMX (3.8-4.1x less prefill time than fp32); else int8
    where the tiles' sums run on AVX512-VNNI (not the AVX2 build's AVX-VNNI; an AMD
    EPYC: the tiles 1.1-2.3x oneDNN's bf16 at 16-512 rows, the conversation trace served
    1.15-1.4x faster than in bf16, its chunks still attending in bf16; an Intel Xeon whose
    AMX is not offered: oneDNN's bf16 1.7x slower than its fp32, the tiles 1.6-2.3x
    faster), for a checkpoint whose
    matrices are mostly in such blocks (int8 leaves the others in fp32); else bf16 where
    it outruns fp32 (AVX-512 BF16 on AMD, 2x); else exact fp32. Decode activations asked
    in fp32 rule int8 out."""
    if cpu_has_amx():
        return "bf16", "steps of 16+ tokens run in bf16 (AMX)"
    int8_pays = tiled_share >= TILED_SHARE_FOR_INT8 and config.decode_activations != "fp32"
    kernels = cpu_kernels()
    if int8_pays and cpu_int8_outruns_fp32(kernels):
        attention = "bf16" if bf16_chunk_attention("int8") else "fp32"
        return "int8", (
            "steps of 16+ tokens multiply GGUF blocks that tile on int8 activations "
            f"({kernels.tiles_vnni_name()}), other matmuls in fp32, prompts attending "
            f"in {attention}"
        )
    if cpu_bf16_outruns_fp32():
        return "bf16", "steps of 16+ tokens run in bf16 (AVX-512 BF16 on AMD)"
    return "fp32", "no bf16 or int8 units that outrun fp32 here, prefill stays exact fp32"


def bf16_chunk_attention(prefill: str) -> bool:
    """Whether int8 prefill steps' chunks attend in bf16 products (q, keys, values and the
    softmax weights rounded to bf16; scores, softmax and sums in fp32), as bf16 steps'
    do: where bf16 was measured to outrun fp32 (AMX; AVX-512 BF16 on AMD, whose bf16
    attention kernel is 1.4-1.7x the fp32 one). On the trace there the fp32 kernel was a
    third of int8 prefill's time (docs/benchmarks.md)."""
    return prefill == "int8" and cpu_bf16_outruns_fp32()


def int8_decode(config: EngineConfig, prefill: str) -> bool:
    """Whether decode steps on GGUF blocks round their activations to int8
    (decode_activations int8, or prefill too in int8, or auto where matmul_precision is
    not ieee and the kernels are an x86 build, whose integer products are faster than
    fp32's)."""
    if prefill == "int8":
        return True  # (fp32 refused with it: prefill_precision)
    if config.decode_activations != "auto":
        return config.decode_activations == "int8"
    kernels = cpu_kernels()
    return (
        config.matmul_precision != "ieee"
        and kernels is not None
        and kernels.isa in ("avx512", "avx2")
    )

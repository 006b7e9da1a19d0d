"""Attention over the paged KV cache, behind one interface.

The model runner builds an `AttentionMetadata` once per step; every attention layer
calls `backend.forward(q, k, v, kv_cache, meta)`, which writes this step's keys and
values into the cache and attends over each sequence's whole context.

Batch layout chosen by the runner: decode sequences (one query token each) first, then
prefill chunks, so decode queries are the contiguous slice [0, num_decodes):

    tokens:  [d0 d1 d2 | p0 p0 p0 p0 | p1 p1 ]
              decodes    prefill 0    prefill 1

The cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim]; token
position p of a sequence lives in block block_table[p // block_size] at offset
p % block_size, i.e. flat slot block_id * block_size + p % block_size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ember.engine.padded_rows import empty_padded_rows


@dataclass
class PrefillSeq:
    query_start: int  # first token of this chunk in the batch
    query_len: int
    context_len: int  # tokens of context after this step (computed before + this chunk)
    block_ids: torch.Tensor  # [num_blocks] covering context_len


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot of each token
    num_decodes: int
    decode_block_table: torch.Tensor | None  # [num_decodes, max_blocks]
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size]; True attends
    decode_context_lens: torch.Tensor | None  # [num_decodes] tokens each decode attends to
    prefills: list[PrefillSeq]
    # the sequences the decode rows belong to (speculative decoding: a row per draft too)
    num_decode_seqs: int | None = None


class AttentionBackend(ABC):
    """Computes attention for one layer of a scheduled batch.

    Called by every attention layer once per step, with this step's q [T, H, D] and
    k, v [T, Hkv, D]. Must first store k and v at `meta.slot_mapping` in `kv_cache`
    (so later steps, and other sequences sharing prefix blocks, see them), then return
    the attention output [T, H, D] in q's dtype, causal within each sequence.
    k and v come in the cache's dtype; q may come in a lower one (bf16 prefill steps on
    CPU), in which prefill attention then runs (decode attention reads the cache as is).
    """

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor: ...


class TorchSDPABackend(AttentionBackend):
    """torch's scaled_dot_product_attention over gathered blocks; runs on CPU and CUDA.

    Decodes run as one batched call: the query heads that share a KV head are laid
    along the query axis ([B, Hkv, group, D]), so GQA needs no copy of K and V.
    A prefill chunk with no earlier context attends to its own k, v directly.
    On CUDA, torch's cuDNN attention is left out (see CUDA_SDPA_BACKENDS).
    """

    def forward(self, q, k, v, kv_cache, meta, scale):
        if q.is_cuda:
            with sdpa_kernel(CUDA_SDPA_BACKENDS):
                return self._forward(q, k, v, kv_cache, meta, scale)
        return self._forward(q, k, v, kv_cache, meta, scale)

    def _forward(self, q, k, v, kv_cache, meta, scale):
        self._write(k, v, kv_cache, meta.slot_mapping)
        if not meta.prefills:  # decodes only: the common step
            return self._decode(q, kv_cache, meta, scale).to(q.dtype)
        if not meta.num_decodes and len(meta.prefills) == 1:  # one chunk: no copy into `out`
            return self._prefill(q, k, v, kv_cache, meta.prefills[0], scale)
        out = (
            empty_padded_rows(*q.shape, dtype=q.dtype)  # an o_proj matmul reads it next
            if q.dtype == torch.bfloat16 and not q.is_cuda
            else torch.empty_like(q)
        )
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], kv_cache, meta, scale)
        for seq in meta.prefills:
            chunk = slice(seq.query_start, seq.query_start + seq.query_len)
            out[chunk] = self._prefill(q[chunk], k[chunk], v[chunk], kv_cache, seq, scale)
        return out

    @staticmethod
    def _write(k, v, kv_cache, slot_mapping):
        num_kv_heads, head_dim = kv_cache.shape[-2:]
        kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, k.to(kv_cache.dtype)
        )
        kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, v.to(kv_cache.dtype)
        )

    @staticmethod
    def _decode(q, kv_cache, meta, scale):
        """Decode attention in the wider of q's and the cache's dtypes (a bf16 step's q over
        a float32 cache, float32 q over a bf16 one: float32); the caller casts it back."""
        dtype = torch.promote_types(q.dtype, kv_cache.dtype)
        q = q.to(dtype)
        num_seqs, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[-2]
        keys = gather_blocks(kv_cache[0], meta.decode_block_table).to(dtype)  # [B, Hkv, L, D]
        values = gather_blocks(kv_cache[1], meta.decode_block_table).to(dtype)
        grouped_q = q.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped_q, keys, values, attn_mask=meta.decode_mask, scale=scale
        )
        return out.reshape(num_seqs, num_heads, head_dim)

    @staticmethod
    def _prefill(q, k, v, kv_cache, seq: PrefillSeq, scale):
        q = q.transpose(0, 1).unsqueeze(0)  # [1, H, Tq, D]
        if seq.context_len == seq.query_len:  # no earlier context: plain causal attention
            # (k, v as the cache keeps them, as the chunk's later tokens will read them)
            keys, values = (x.to(kv_cache.dtype).transpose(0, 1) for x in (k, v))
            mask = None
        else:
            table = seq.block_ids.unsqueeze(0)
            keys = gather_blocks(kv_cache[0], table)[0, :, : seq.context_len]
            values = gather_blocks(kv_cache[1], table)[0, :, : seq.context_len]
            mask = causal_mask(seq.query_len, seq.context_len, q.device)
        out = F.scaled_dot_product_attention(
            q,
            keys.unsqueeze(0).to(q.dtype),  # bf16 prefill: SDPA runs on AMX / AVX-512 BF16
            values.unsqueeze(0).to(q.dtype),
            attn_mask=mask,
            is_causal=mask is None,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)


# torch picks cuDNN's attention first on Hopper, and it costs ~0.8 ms of CPU time per call
# (measured on an H100, torch 2.11: 48% of a decode step's CPU time, 37 ms per step of a
# 30-layer model at batch 1); flash, memory-efficient or math attention instead
CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def gather_blocks(cache: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hkv, D] indexed by [B, M] -> [B, Hkv, M * bs, D]."""
    num_seqs, num_blocks = block_table.shape
    _, block_size, num_kv_heads, head_dim = cache.shape
    blocks = cache.index_select(0, block_table.flatten())  # 3x faster than cache[table]
    return blocks.view(num_seqs, num_blocks * block_size, num_kv_heads, head_dim).transpose(1, 2)


def causal_mask(query_len: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i (at position context_len - query_len + i) sees keys at positions <= its own."""
    query_pos = torch.arange(context_len - query_len, context_len, device=device)
    key_pos = torch.arange(context_len, device=device)
    return key_pos.unsqueeze(0) <= query_pos.unsqueeze(1)


# a bf16 prefill chunk of at least this many rows attends through torch's bf16 SDPA on a
# CPU with AMX where ember's AMX kernel cannot run: 1.6-2.5x faster there than ember's fp32
# kernel from 128 rows on, slower at 16 (docs/benchmarks.md, "Prefill attention on an AMX
# CPU")
AMX_SDPA_MIN_ROWS = 64


class CPUPagedBackend(TorchSDPABackend):
    """Attends with ember's C++ kernels, which read K and V blocks in place (no gathered
    copy of every context, which at 64 sequences costs more than the matmuls): decodes in
    one batched call, prefill chunks one by one, causal without a mask. A bf16 prefill
    chunk (a bf16 step) attends in bf16 products: on AMX tiles where `amx` (the CPU has
    them and Linux grants them: 1.8-2.7x torch's bf16 SDPA, docs/benchmarks.md), else on the
    CPU's bf16 dot product where `bf16_dot` (AVX512-BF16: 1.4-1.7x the fp32 kernel's
    speed), and through torch's bf16 SDPA from AMX_SDPA_MIN_ROWS rows where `bf16_sdpa` but
    not `amx` (torch's oneDNN attention on the tiles); head sizes the prefill kernels have
    no build for go to torch's SDPA. CPU; a float32 or bfloat16 cache (kv_cache_dtype),
    which the kernels widen to float32 as they read it."""

    def __init__(
        self,
        kernels,
        bf16_sdpa: bool | None = None,
        bf16_dot: bool | None = None,
        amx: bool | None = None,
    ):
        from ember.models.layers import cpu_has_amx

        self.kernels = kernels
        self.prefill_head_dims = frozenset(kernels.prefill_head_dims)
        self.amx = kernels.amx_supported() if amx is None else amx
        self.bf16_sdpa = cpu_has_amx() if bf16_sdpa is None else bf16_sdpa
        self.bf16_dot = kernels.bf16_dot_supported() if bf16_dot is None else bf16_dot
        # float32 chunks (int8 prefill steps) attend in bf16 products too where the CPU
        # has them (attends_bf16), q rounded to bf16 and the output widened back
        # (ModelRunner sets it: precision.bf16_chunk_attention)
        self.bf16_chunks = False

    @property
    def attends_bf16(self) -> bool:
        """Whether a bf16 chunk attends in bf16 products here (AMX or AVX512-BF16), not
        in the float32 kernel."""
        return self.amx or self.bf16_dot

    def _write(self, k, v, kv_cache, slot_mapping):
        self.kernels.write_kv(k, v, kv_cache[0], kv_cache[1], slot_mapping)

    def _prefill(self, q, k, v, kv_cache, seq: PrefillSeq, scale):
        """ember's kernel over the blocks in place (this chunk's keys are in the cache
        already), causal without a mask; a bf16 step's chunk in bf16 products where the CPU
        multiplies bf16 pairs, else in float32 (at SmolLM2's shapes 1.3-2x faster than
        torch's SDPA in either dtype, docs/benchmarks.md)."""
        if self.bf16_chunks and q.dtype == torch.float32 and self.attends_bf16:
            return self._prefill(q.to(torch.bfloat16), k, v, kv_cache, seq, scale).float()
        bf16 = q.dtype == torch.bfloat16
        if q.shape[-1] not in self.prefill_head_dims or (
            bf16 and not self.amx and self.bf16_sdpa and seq.query_len >= AMX_SDPA_MIN_ROWS
        ):
            return super()._prefill(q, k, v, kv_cache, seq, scale)
        cache = (kv_cache[0], kv_cache[1], seq.block_ids, seq.context_len, scale)
        if bf16 and self.amx:
            return self.kernels.paged_prefill_attention_amx(q.contiguous(), *cache)
        if bf16 and self.bf16_dot:
            return self.kernels.paged_prefill_attention_bf16(q.contiguous(), *cache, True)
        return self.kernels.paged_prefill_attention(q.float().contiguous(), *cache).to(q.dtype)

    def _decode(self, q, kv_cache, meta, scale):
        return self.kernels.paged_decode_attention(
            q.float().contiguous(),  # float32 q over either cache dtype
            kv_cache[0],
            kv_cache[1],
            meta.decode_block_table,
            meta.decode_context_lens,
            scale,
        )


BACKENDS = ("auto", "sdpa", "cpu-paged")


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype) -> AttentionBackend:
    """The backend for a device; `auto` takes the fastest one that works here. A paged
    CUDA kernel slots in here too."""
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(BACKENDS)}; got {name!r}")
    if name != "sdpa" and device.type == "cpu" and dtype == torch.float32:
        from ember.engine.kernels import cpu_kernels

        kernels = cpu_kernels()
        if kernels is not None:
            return CPUPagedBackend(kernels)
        if name == "cpu-paged":
            raise ValueError("attention_backend 'cpu-paged': the C++ kernel could not be built")
    elif name == "cpu-paged":
        raise ValueError("attention_backend 'cpu-paged' needs device cpu and dtype float32")
    return TorchSDPABackend()

"""Attention backends agree with each other and with plain causal attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ember.engine.attention import (
    AttentionMetadata,
    PrefillSeq,
    TorchSDPABackend,
    get_attention_backend,
)
from ember.engine.kernels import cpu_kernels, supported_isas

BS, HKV, GROUP, D = 16, 2, 3, 32
H = HKV * GROUP


def reference(q, k, v):
    """Causal attention of one whole sequence: q [T, H, D], k/v [T, Hkv, D]."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
    )
    return out.transpose(0, 1)


def run_step(backend, kv_cache, seqs, num_done):
    """One step: each sequence computes its tokens [num_done[i], len) over the paged cache.

    Sequences with one new token are decodes (first in the batch); blocks are scattered.
    """
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]) - num_done[i] != 1)
    qs, ks, vs, slots, prefills, tables, lens = [], [], [], [], [], [], []
    num_decodes, start = 0, 0
    for i in order:
        q, k, v, table = seqs[i]
        n0, n = num_done[i], len(q)
        pos = torch.arange(n0, n)
        qs.append(q[n0:]), ks.append(k[n0:]), vs.append(v[n0:])
        slots.append(table[pos // BS] * BS + pos % BS)
        if n - n0 == 1:
            num_decodes += 1
            tables.append(table), lens.append(n)
        else:
            prefills.append(PrefillSeq(start, n - n0, n, table))
        start += n - n0
    width = max((len(t) for t in tables), default=0)
    table = torch.zeros(len(tables), width, dtype=torch.long)
    for i, t in enumerate(tables):
        table[i, : len(t)] = t
    lens_t = torch.tensor(lens, dtype=torch.long)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decodes=num_decodes,
        decode_block_table=table if num_decodes else None,
        decode_mask=(torch.arange(width * BS)[None] < lens_t[:, None])[:, None, None]
        if num_decodes
        else None,
        decode_context_lens=lens_t if num_decodes else None,
        prefills=prefills,
    )
    scale = qs[0].shape[-1] ** -0.5
    out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), kv_cache, meta, scale)
    return dict(zip(order, out.split([len(seqs[i][0]) - num_done[i] for i in order]), strict=True))


# the C++ decode kernel holds a KV head's query group in registers for heads of 2, 4 or 8
# vectors and groups up to 8 (while the sums fit: group x vectors <= 24), else keeps its
# sums in registers for heads of 4 or 8 vectors (64 and 128 floats with AVX-512, 32 and
# 64 with 8-lane vectors), takes vector-wide dot products for multiples of the vector
# width, and plain loops otherwise; every build the CPU runs is checked
@pytest.mark.parametrize(
    "head_dim, group",
    [(D, GROUP), (40, GROUP), (64, GROUP), (96, GROUP), (128, GROUP), (64, 1), (64, 4),
     (64, 7), (128, 2), (16, 8)],
)  # fmt: skip
@pytest.mark.parametrize("name", ["sdpa", *(f"auto-{isa}" for isa in supported_isas())])
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_mixed_step_over_scattered_blocks_matches_causal_attention(
    name, head_dim, group, cache_dtype, cpu_isa
):
    """(A bf16 cache: attention over the keys and values rounded to bf16.)"""
    if name.startswith("auto-"):
        name, isa = name.split("-")
        cpu_isa(isa)
    backend = get_attention_backend(name, torch.device("cpu"), torch.float32)
    if name == "auto":
        assert backend.kernels.isa == isa
    torch.manual_seed(0)
    kv_cache = torch.zeros(2, 64, BS, HKV, head_dim, dtype=cache_dtype)
    lengths, done = [1, 17, 40, 90, 33], [0, 16, 39, 50, 0]  # decodes, a chunk, fresh prefills
    free = torch.randperm(64)
    seqs, used = [], 0
    for n in lengths:
        num_blocks = -(-n // BS)
        table = free[used : used + num_blocks]
        used += num_blocks
        q, k, v = (torch.randn(n, heads, head_dim) for heads in (HKV * group, HKV, HKV))
        seqs.append((q, k, v, table))
    # fill the cache with what earlier steps would have written
    for (_, k, v, table), n0 in zip(seqs, done, strict=True):
        pos = torch.arange(n0)
        flat = table[pos // BS] * BS + pos % BS
        kv_cache[0].view(-1, HKV, head_dim)[flat] = k[:n0].to(cache_dtype)
        kv_cache[1].view(-1, HKV, head_dim)[flat] = v[:n0].to(cache_dtype)
    outs = run_step(backend, kv_cache, seqs, done)
    for i, (q, k, v, _) in enumerate(seqs):
        k, v = (x.to(cache_dtype).float() for x in (k, v))
        torch.testing.assert_close(outs[i], reference(q, k, v)[done[i] :], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("isa", supported_isas())
def test_a_bf16_cache_reads_as_a_float32_cache_of_the_same_values(isa):
    """Every kernel that reads the cache widens a bf16 one exactly: its results are those
    over a float32 cache holding the same values, bit for bit, on every build (decodes on
    each head path, prefill chunks in float32 and in bf16 products); write_kv rounds to
    bf16 as torch does (nearest even, a NaN stays a NaN). A bf16 cache's keys and values
    go into the bf16 kernels' pair layout as they are, a float32 one's rounded first."""
    kernels = cpu_kernels(isa)
    if kernels is None:
        pytest.skip(f"the {isa} kernels could not be built here")
    torch.manual_seed(0)
    num_blocks, group = 32, 3
    for head_dim in (32, 64, 40):  # 40: no vector path for the head on any build
        shape = (num_blocks, BS, HKV, head_dim)
        low = [torch.randn(shape).bfloat16() for _ in range(2)]
        wide = [x.float() for x in low]
        q = torch.randn(3, HKV * group, head_dim)
        tables = torch.randperm(num_blocks)[:30].view(3, 10)
        lens = torch.tensor([5, 77, 160])
        assert torch.equal(
            kernels.paged_decode_attention(q, *low, tables, lens, 0.125),
            kernels.paged_decode_attention(q, *wide, tables, lens, 0.125),
        )
        if head_dim not in kernels.prefill_head_dims:
            continue
        chunk = torch.randn(20, HKV * group, head_dim)
        assert torch.equal(
            kernels.paged_prefill_attention(chunk, *low, tables[2], 150, 0.125),
            kernels.paged_prefill_attention(chunk, *wide, tables[2], 150, 0.125),
        )
        for dot in [False, *([True] if kernels.bf16_dot_supported() else [])]:
            args = (tables[2], 150, 0.125, dot)
            assert torch.equal(
                kernels.paged_prefill_attention_bf16(chunk.bfloat16(), *low, *args),
                kernels.paged_prefill_attention_bf16(chunk.bfloat16(), *wide, *args),
            )
        if kernels.amx_supported():
            args = (tables[2], 150, 0.125)
            assert torch.equal(
                kernels.paged_prefill_attention_amx(chunk.bfloat16(), *low, *args),
                kernels.paged_prefill_attention_amx(chunk.bfloat16(), *wide, *args),
            )
    k, v = torch.randn(7, HKV, 40) * 100, torch.randn(7, HKV, 40)
    k[0, 0, :4] = torch.tensor([float("nan"), float("inf"), 1 + 2**-8, 1 + 3 * 2**-8])  # ties
    k[0, 1, :2] = torch.tensor([1e-40, -(1 + 2**-8)])  # a subnormal, a negative tie
    slots = torch.randperm(num_blocks * BS)[:7]
    caches = [torch.zeros(num_blocks, BS, HKV, 40, dtype=torch.bfloat16) for _ in range(2)]
    kernels.write_kv(k, v, *caches, slots)
    for cache, x in zip(caches, (k, v), strict=True):
        stored, nan = cache.view(-1, HKV, 40)[slots], x.isnan()
        assert torch.equal(stored.isnan(), nan)  # (torch keeps a NaN's payload, ember not)
        assert torch.equal(stored[~nan].view(torch.int16), x[~nan].bfloat16().view(torch.int16))
    with pytest.raises(RuntimeError, match="caches in float32 or bfloat16, alike"):
        kernels.write_kv(k, v, caches[0], torch.zeros(num_blocks, BS, HKV, 40), slots)
    # a prompt chunk's rows (written on the threads at once), strided rows as a qkv split
    # leaves them, into either cache dtype: where torch's index_copy puts them, nothing else
    qkv = torch.randn(300, 3 * HKV, 40)
    k, v = qkv[:, HKV : 2 * HKV], qkv[:, 2 * HKV :]
    slots = torch.randperm(num_blocks * BS)[:300]
    for dtype in (torch.float32, torch.bfloat16):
        caches = [torch.zeros(num_blocks, BS, HKV, 40, dtype=dtype) for _ in range(2)]
        kernels.write_kv(k, v, *caches, slots)
        for cache, x in zip(caches, (k, v), strict=True):
            expected = torch.zeros_like(cache).view(-1, HKV, 40).index_copy_(0, slots, x.to(dtype))
            assert torch.equal(cache.view(-1, HKV, 40), expected)


def test_auto_picks_the_cpu_kernel_for_float32_cpu():
    backend = get_attention_backend("auto", torch.device("cpu"), torch.float32)
    assert type(backend).__name__ == "CPUPagedBackend"
    assert isinstance(
        get_attention_backend("auto", torch.device("cpu"), torch.bfloat16), TorchSDPABackend
    )


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ValueError, match="attention_backend"):
        get_attention_backend("flash", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("amx", [True, False])
@pytest.mark.parametrize("bf16_dot", [True, False])
@pytest.mark.parametrize("bf16_sdpa", [True, False])
def test_bf16_prefill_chunks_take_the_fastest_route_the_cpu_has(
    bf16_sdpa, bf16_dot, amx, monkeypatch
):
    """Where ember's AMX kernel runs (`amx`) every bf16 prefill chunk attends through it.
    Else, on a CPU with AMX (`bf16_sdpa`, forced here) a bf16 prefill chunk of 64 rows or
    more attends through torch's bf16 SDPA; a shorter one (every one without AMX) through
    ember's kernel, in bf16 products where the CPU has a bf16 dot product (`bf16_dot`),
    else in float32. The results stay within bf16 rounding of causal attention."""
    from ember.engine.attention import AMX_SDPA_MIN_ROWS, CPUPagedBackend
    from ember.engine.kernels import cpu_kernels

    kernels = cpu_kernels()
    if bf16_dot and not kernels.bf16_dot_supported():
        pytest.skip("this CPU has no bf16 dot product (AVX512-BF16)")
    if amx and not kernels.amx_supported():
        pytest.skip("this CPU or build has no AMX tiles")
    rows, sdpa_prefill = [], TorchSDPABackend._prefill

    def counted(q, k, v, kv_cache, seq, scale):
        rows.append(seq.query_len)
        return sdpa_prefill(q, k, v, kv_cache, seq, scale)

    calls = {"amx": 0, "bf16": 0, "fp32": 0}

    class Counted:  # the kernels, counting the prefill calls of each kind
        def __getattr__(self, name):
            if name.startswith("paged_prefill_attention"):
                kind = name.removeprefix("paged_prefill_attention").lstrip("_") or "fp32"
                calls[kind] += 1
            return getattr(kernels, name)

    monkeypatch.setattr(TorchSDPABackend, "_prefill", staticmethod(counted))
    backend = CPUPagedBackend(Counted(), bf16_sdpa=bf16_sdpa, bf16_dot=bf16_dot, amx=amx)
    torch.manual_seed(0)
    head_dim = 64
    kv_cache = torch.zeros(2, 64, BS, HKV, head_dim)
    lengths, done = [1, 17, 90, AMX_SDPA_MIN_ROWS - 1], [0, 0, 0, 0]
    seqs, free, used = [], torch.randperm(64), 0
    for n in lengths:
        table = free[used : used + -(-n // BS)]
        used += len(table)
        q, k, v = (torch.randn(n, heads, head_dim) for heads in (H, HKV, HKV))
        seqs.append((q, k, v, table))
    low = [(q.bfloat16(), k, v, table) for q, k, v, table in seqs]
    outs = run_step(backend, kv_cache, low, done)
    for i, (q, k, v, _) in enumerate(seqs):
        torch.testing.assert_close(outs[i].float(), reference(q, k, v), atol=3e-2, rtol=0)
    assert rows == ([90] if bf16_sdpa and not amx else [])
    kernel_calls = sum(n > 1 for n in lengths) - len(rows)  # a 1-token chunk decodes
    kind = "amx" if amx else ("bf16" if bf16_dot else "fp32")
    assert calls == {"amx": 0, "bf16": 0, "fp32": 0} | {kind: kernel_calls}


@pytest.mark.parametrize("kind", ["amx", "bf16", "fp32"])
def test_float32_chunks_attend_in_bf16_products_where_asked(kind):
    """`bf16_chunks` (int8 prefill steps where bf16 outruns fp32): a float32 chunk is
    attended as the same chunk in bf16 would be, bit for bit, and comes back in float32;
    a decode in the same step keeps float32 q. Without bf16 units (`fp32`) nothing is
    rounded: the float32 kernel's result, within float32 rounding of causal attention."""
    from ember.engine.attention import CPUPagedBackend
    from ember.engine.kernels import cpu_kernels

    kernels = cpu_kernels()
    if kind == "bf16" and not kernels.bf16_dot_supported():
        pytest.skip("this CPU has no bf16 dot product (AVX512-BF16)")
    if kind == "amx" and not kernels.amx_supported():
        pytest.skip("this CPU or build has no AMX tiles")
    backend = CPUPagedBackend(kernels, bf16_sdpa=False, bf16_dot=kind == "bf16", amx=kind == "amx")
    assert backend.attends_bf16 == (kind != "fp32")
    torch.manual_seed(1)
    head_dim, lengths = 64, [40, 23, 7]
    seqs, free, used = [], torch.randperm(64), 0
    for n in lengths:
        table = free[used : used + -(-n // BS)]
        used += len(table)
        seqs.append((*(torch.randn(n, heads, head_dim) for heads in (H, HKV, HKV)), table))
    done = [0, 22, 0]  # the second sequence decodes its 23rd token
    kv_cache = torch.zeros(2, 64, BS, HKV, head_dim)
    run_step(backend, kv_cache, [(q[:22], k[:22], v[:22], t) for q, k, v, t in seqs[1:2]], [0])
    as_bf16 = run_step(
        backend, kv_cache.clone(), [(q.bfloat16(), *rest) for q, *rest in seqs], done
    )
    backend.bf16_chunks = True
    outs = run_step(backend, kv_cache, seqs, done)
    for i, (q, k, v, _) in enumerate(seqs):
        assert outs[i].dtype == torch.float32
        n0 = done[i]
        exact = reference(q, k, v)[n0:]
        if i == 1:  # the decode: float32 q either way
            torch.testing.assert_close(outs[i], exact, atol=1e-5, rtol=0)
        elif kind == "fp32":
            torch.testing.assert_close(outs[i], exact, atol=1e-5, rtol=0)
        else:
            assert torch.equal(outs[i], as_bf16[i].float())
            assert 1e-4 < (outs[i] - exact).abs().max() < 3e-2

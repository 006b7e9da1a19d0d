"""One layer's prefill attention: ember's kernels (fp32, and bf16 on the CPU's bf16 dot
product where it has one) against torch's SDPA (fp32 and bf16).

    python benchmarks/prefill_attention.py [--heads 9 --kv-heads 3 --head-dim 64]
        [--cache-dtype bfloat16]

For each chunk x context shape, the kernel reads a paged cache (16-token blocks in a
shuffled order) and SDPA a gathered copy with the chunk's causal mask, as the backends
do; prints the largest difference from SDPA fp32 and the median time of each, per call.
"ember bf16" is the bf16 kernel on the CPU's bf16 dot product (bf16 q and products, float32
cache), "ember amx" the same attention on AMX tiles where the CPU has them. The cache is
float32, or bf16 with --cache-dtype bfloat16 (what `kv_cache_dtype` auto picks where
prefill runs in bf16). The last two shapes are agent turns: a few new tokens over a
long cached context, which every call pairs again.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from ember.engine.kernels import cpu_kernels

SHAPES = [(512, 512), (509, 2270), (128, 1500), (16, 700), (58, 618), (16, 2016)]


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(kernels, tokens, context, heads, kv_heads, dim, repeats, cache_dtype) -> str:
    block, scale = 16, dim**-0.5
    num_blocks = -(-context // block)
    key_cache = torch.randn(num_blocks + 4, block, kv_heads, dim).to(cache_dtype)
    value_cache = torch.randn_like(key_cache)
    table = torch.randperm(num_blocks + 4)[:num_blocks]
    q = torch.randn(tokens, heads, dim)

    def sdpa(dtype):
        keys = key_cache.index_select(0, table).view(-1, kv_heads, dim)[:context]
        values = value_cache.index_select(0, table).view(-1, kv_heads, dim)[:context]
        pos = torch.arange(context - tokens, context)
        mask = torch.arange(context)[None, :] <= pos[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None].to(dtype),
            keys.transpose(0, 1)[None].to(dtype),
            values.transpose(0, 1)[None].to(dtype),
            attn_mask=mask,
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)

    def ember():
        return kernels.paged_prefill_attention(q, key_cache, value_cache, table, context, scale)

    q_bf16 = q.bfloat16()
    native = kernels.bf16_dot_supported()

    def ember_bf16():
        return kernels.paged_prefill_attention_bf16(
            q_bf16, key_cache, value_cache, table, context, scale, native
        )

    def ember_amx():
        return kernels.paged_prefill_attention_amx(
            q_bf16, key_cache, value_cache, table, context, scale
        )

    reference = sdpa(torch.float32)
    diffs = {"ember": ember(), "bf16": ember_bf16().float()}
    row = {
        "sdpa fp32": timed(lambda: sdpa(torch.float32), repeats),
        "sdpa bf16": timed(lambda: sdpa(torch.bfloat16), repeats),
        "ember": timed(ember, repeats),
        f"ember bf16 ({'bf16 dot' if native else 'fp32 FMAs'})": timed(ember_bf16, repeats),
    }
    if kernels.amx_supported():
        diffs["amx"] = ember_amx().float()
        row["ember amx"] = timed(ember_amx, repeats)
    cells = ", ".join(f"{name} {ms:.2f} ms" for name, ms in row.items())
    errors = ", ".join(
        f"{name} {(out - reference).abs().max().item():.1e}" for name, out in diffs.items()
    )
    return f"{tokens} x {context}: {cells}; max |x - sdpa fp32|: {errors}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--cache-dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    cache_dtype = getattr(torch, args.cache_dtype)
    kernels = cpu_kernels()
    print(
        f"kernels: {kernels.isa}, torch threads: {torch.get_num_threads()}, "
        f"cache: {args.cache_dtype}"
    )
    torch.manual_seed(0)
    for tokens, context in SHAPES:
        print(
            measure(
                kernels,
                tokens,
                context,
                args.heads,
                args.kv_heads,
                args.head_dim,
                args.repeats,
                cache_dtype,
            )
        )


if __name__ == "__main__":
    main()

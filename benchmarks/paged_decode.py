"""Decode attention over the paged KV cache, 30 layers of SmolLM2's shape (9 query heads,
3 KV heads of 64): each sequence's context in blocks of its own ("distinct": the bytes
come from memory, as in serving) or all sequences on one context ("shared": cached, so
this times the arithmetic).

    python benchmarks/paged_decode.py --seqs 8 --context 500
"""

from __future__ import annotations

import argparse
import time

import torch

from ember.engine.kernels import cpu_kernels


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", type=int, default=8)
    p.add_argument("--context", type=int, default=500)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    kernels, block = cpu_kernels(), 16
    per_seq = -(-args.context // block)
    caches = [
        (
            torch.randn(args.seqs * per_seq, block, 3, 64),
            torch.randn(args.seqs * per_seq, block, 3, 64),
        )
        for _ in range(args.layers)
    ]
    tables = {
        "distinct": torch.arange(args.seqs * per_seq).view(args.seqs, per_seq),
        "shared": torch.arange(per_seq).repeat(args.seqs, 1),
    }
    lens = torch.full((args.seqs,), args.context)
    q = torch.randn(args.seqs, 9, 64)
    mb = args.layers * args.seqs * args.context * 2 * 3 * 64 * 4 / 2**20
    for name, table in tables.items():
        for _ in range(2):
            for k, v in caches:
                kernels.paged_decode_attention(q, k, v, table, lens, 0.125)
        start = time.perf_counter()
        for _ in range(args.repeats):
            for k, v in caches:
                kernels.paged_decode_attention(q, k, v, table, lens, 0.125)
        seconds = (time.perf_counter() - start) / args.repeats
        print(
            f"{kernels.isa} {name}: {seconds * 1e3:.2f} ms for {args.layers} layers "
            f"({mb:.0f} MB of keys and values read: {mb / 1024 / seconds:.1f} GB/s)"
        )


if __name__ == "__main__":
    main()

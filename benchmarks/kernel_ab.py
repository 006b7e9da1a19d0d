"""Two builds of ember's CPU kernels against each other, call by call in one process.

    python benchmarks/kernel_ab.py OLD_SO [NEW_SO]

OLD_SO / NEW_SO: a kernel shared object (e.g. one left in ~/.cache/ember/kernels by an
older checkout); NEW_SO defaults to this checkout's build for the CPU. Each case runs
alternately on both, 15 x 10 calls, and the minimum per call is printed: the box's
swings fall on both alike. Sizes are SmolLM2's and stay in L2, so this measures the
kernels' compute; whole-model decode speed is `ember bench offline`'s.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch

from ember.engine.kernels import cpu_kernels


def load(path: str):
    name = Path(path).name.split(".")[0]  # the module name torch built it under
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def per_call_ms(fn, calls: int = 10) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def cases(module):
    """(name, call) pairs; 2-D blocks for builds from before 3-D ones."""
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3072, 576 // 32, 20), dtype=torch.uint8, generator=gen)
    blocks[..., :4] = torch.full((2,), 0.01).half().view(torch.uint8)  # d, m
    try:
        module.block_gemm(torch.randn(1, 576), blocks, None)
    except RuntimeError:
        blocks = blocks.view(3072, -1)
    w = torch.randn(4096, 576)
    for rows in (1, 4, 8):
        x = torch.randn(rows, 576)
        yield f"block Q4_1, {rows} rows", lambda x=x: module.block_gemm(x, blocks, None)
        yield f"small fp32, {rows} rows", lambda x=x: module.small_gemm(x, w, None)
    q, k, v = torch.randn(8, 9, 64), torch.randn(512, 16, 3, 64), torch.randn(512, 16, 3, 64)
    tables, lens = torch.randperm(512)[: 8 * 60].view(8, 60), torch.full((8,), 900)
    yield (
        "paged attention 8 x 900",
        lambda: module.paged_decode_attention(q, k, v, tables, lens, 0.125),
    )


def main() -> None:
    torch.set_num_threads(2)
    old = load(sys.argv[1])
    new = load(sys.argv[2]) if len(sys.argv) > 2 else cpu_kernels()
    for (name, old_call), (_, new_call) in zip(cases(old), cases(new), strict=True):
        old_ms, new_ms = [], []
        for _ in range(15):
            old_ms.append(per_call_ms(old_call))
            new_ms.append(per_call_ms(new_call))
        print(f"{name:26s} old {min(old_ms):7.3f} ms  new {min(new_ms):7.3f} ms  "
              f"new/old {min(new_ms) / min(old_ms):.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

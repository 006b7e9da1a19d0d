"""Two builds of ember's CPU kernels against each other, call by call in one process.

    python benchmarks/kernel_ab.py OLD_SO [NEW_SO]

OLD_SO / NEW_SO: a kernel shared object (e.g. one left in ~/.cache/ember/kernels by an
older checkout); NEW_SO defaults to this checkout's build for the CPU. Each build is
loaded in a process of its own (two builds share their module's name, and one process
would load only the first), and each case runs alternately in the two, 15 x 10 calls;
the minimum per call is printed: the box's swings fall on both alike. Sizes are SmolLM2's and stay in L2, so this measures the
kernels' compute (but for one case read from memory); whole-model decode speed is `ember bench offline`'s.
"""

from __future__ import annotations

import importlib.util
import itertools
import subprocess
import sys
import time
from pathlib import Path

import torch

from ember.engine.kernels import cpu_kernels

# block bytes and fp16 fields of each format the int8 cases run
INT8_FORMATS = {"Q4_1": (20, (0, 2)), "Q5_0": (22, (0,)), "Q8_0": (34, (0,)),
                "Q4_K": (144, (0, 2)), "Q6_K": (210, (208,))}  # fmt: skip
WEIGHTS = {"Q4_1": 32, "Q5_0": 32, "Q8_0": 32, "Q4_K": 256, "Q6_K": 256}


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
    if hasattr(module, "block_gemm_int8"):  # int8 activations, each block format
        for name, (block_bytes, half_fields) in INT8_FORMATS.items():
            k_dim = 1536 if block_bytes > 34 else 576  # K-quants: 256 weights a block
            rows = torch.randint(0, 256, (576, k_dim * block_bytes // WEIGHTS[name]),
                                 dtype=torch.uint8, generator=gen).view(576, -1, block_bytes)  # fmt: skip
            for offset in half_fields:  # small fp16 scales: no inf or nan
                rows[..., offset : offset + 2] = torch.full((1,), 0.01).half().view(torch.uint8)
            x = torch.randn(1, k_dim)
            yield f"int8 {name}, 1 row", lambda x=x, w=rows: module.block_gemm_int8(x, w, None)
        # from memory: SmolLM2's gate_up in Q8_0, one of 30 copies a call (110 MB), as a
        # decode step streams its layers
        copies = [torch.randint(0, 256, (3072, 18, 34), dtype=torch.uint8, generator=gen)
                  for _ in range(30)]  # fmt: skip
        for copy in copies:
            copy[..., :2] = torch.full((1,), 0.01).half().view(torch.uint8)
        turn, x = itertools.count(), torch.randn(1, 576)
        yield (
            "int8 Q8_0, 1 row, memory",
            lambda: module.block_gemm_int8(x, copies[next(turn) % 30], None),
        )
    q, k, v = torch.randn(8, 9, 64), torch.randn(512, 16, 3, 64), torch.randn(512, 16, 3, 64)
    tables, lens = torch.randperm(512)[: 8 * 60].view(8, 60), torch.full((8,), 900)
    yield (
        "paged attention 8 x 900",
        lambda: module.paged_decode_attention(q, k, v, tables, lens, 0.125),
    )


def serve(path: str) -> None:
    """A worker: loads one build, then times the case named by each line on stdin."""
    torch.set_num_threads(2)
    calls = dict(cases(load(path) if path != "-" else cpu_kernels()))
    for line in sys.stdin:
        print(per_call_ms(calls[line.strip()]), flush=True)


def main() -> None:
    if sys.argv[1] == "--serve":
        return serve(sys.argv[2])
    paths = [sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "-"]
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, "--serve", path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for path in paths
    ]

    def timed(worker, name: str) -> float:
        worker.stdin.write(name + "\n")
        worker.stdin.flush()
        return float(worker.stdout.readline())

    torch.set_num_threads(1)
    for name, _ in cases(cpu_kernels()):
        old_ms, new_ms = [], []
        for _ in range(15):
            old_ms.append(timed(workers[0], name))
            new_ms.append(timed(workers[1], name))
        print(f"{name:26s} old {min(old_ms):7.3f} ms  new {min(new_ms):7.3f} ms  "
              f"new/old {min(new_ms) / min(old_ms):.3f}")  # fmt: skip
    for worker in workers:
        worker.stdin.close()
        worker.wait()


if __name__ == "__main__":
    main()

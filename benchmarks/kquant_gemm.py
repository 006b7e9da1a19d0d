"""K-quant blocks in decode: ember's block GEMM on a Q4_K / Q6_K weight against its small
GEMM on the same weight dequantized to fp32 (what decode ran before: bit-identical
results), on one matmul shape (default SmolLM2's down_proj, 576 x 1536) at a few rows.

The two alternate call by call (`--repeats` rounds, each `--calls` calls of one, then of
the other), so a noisy, shared box slows both alike; the minimum per call is printed
(the least disturbed), with the median beside it and the bytes of W read per second.

With `--copies N` each call reads the next of N copies of W (SmolLM2's 30 down_proj
weights: 106 MB in fp32), as a decode step does, instead of one that stays in L2.

    python benchmarks/kquant_gemm.py [--formats Q4_K,Q6_K] [--rows 1,4,8] [--shape 576x1536]
        [--copies 1] [--repeats 300] [--calls 10] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import gguf
import torch

from ember.engine.kernels import cpu_kernels
from ember.loader.dequant import dequantize

# fp16 fields of each block (d, dmin): everything else is random codes and sub-block scales
HALF_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "Q8_0": (0,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="Q4_K,Q6_K")
    parser.add_argument("--rows", default="1,4,8")
    parser.add_argument("--shape", default="576x1536", help="out_features x in_features")
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("ember's CPU kernels could not be built here")
    torch.set_num_threads(args.threads)
    out_features, in_features = map(int, args.shape.split("x"))
    print(
        f"{kernels.isa} build, {args.threads} threads, W {out_features} x {in_features}"
        f" ({args.copies} copies)"
    )
    print("format rows  kernel       min us  median us   GB/s (min)")
    for name in args.formats.split(","):
        blocks = [random_blocks(name, out_features, in_features) for _ in range(args.copies)]
        weights = [fp32(b, name) for b in blocks]
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, in_features)
            for b, w in zip(blocks, weights, strict=True):
                assert torch.equal(kernels.block_gemm(x, b, None), kernels.small_gemm(x, w, None))
            runs = {
                "block_gemm": (cycle(kernels.block_gemm, x, blocks), blocks[0]),
                "small_gemm": (cycle(kernels.small_gemm, x, weights), weights[0]),
            }
            times = interleaved(runs, args.repeats, args.calls)
            for kernel, (_, w) in runs.items():
                fastest, median = min(times[kernel]), statistics.median(times[kernel])
                size = w.numel() * w.element_size()
                print(
                    f"{name:6s} {rows:4d}  {kernel:11s} {fastest * 1e6:7.1f} {median * 1e6:10.1f}"
                    f" {size / fastest / 1e9:8.1f}"
                )


def fp32(blocks: torch.Tensor, name: str) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[name]
    return torch.from_numpy(dequantize(blocks.flatten(1).numpy(), qtype)).reshape(
        blocks.shape[0], -1
    )


def cycle(kernel, x: torch.Tensor, ws: list[torch.Tensor]):
    """A call of `kernel` on x and the next of ws, round and round."""
    state = {"next": 0}

    def run():
        w = ws[state["next"]]
        state["next"] = (state["next"] + 1) % len(ws)
        return kernel(x, w, None)

    return run


def interleaved(runs: dict, repeats: int, calls: int) -> dict[str, list[float]]:
    """Seconds per call of each run, `calls` at a time, the runs taking turns."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, (run, _) in runs.items():
            start = time.perf_counter()
            for _ in range(calls):
                run()
            if repeat:
                times[name].append((time.perf_counter() - start) / calls)
    return times


def random_blocks(name: str, out_features: int, in_features: int) -> torch.Tensor:
    """[out, blocks per row, bytes per block] of random codes and sub-block scales, with
    small positive fp16 d (and dmin)."""
    block_weights, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]]
    num_blocks = out_features * in_features // block_weights
    blocks = torch.randint(0, 256, (num_blocks, block_bytes), dtype=torch.uint8)
    for offset in HALF_FIELDS[name]:
        halves = (torch.rand(num_blocks) * 1e-3).half()
        blocks[:, offset : offset + 2] = halves.view(torch.uint8).view(-1, 2)
    return blocks.view(out_features, -1, block_bytes)


if __name__ == "__main__":
    main()

"""All-reduce among the ranks of one host: ember's shared-memory path against Gloo.

    python benchmarks/all_reduce.py [--ranks 2] [--iters 20]

Two (or `--ranks`) spawned processes, one thread each, sum fp32 tensors of 4 KB to
64 MB; per size and path, the median of `--iters` calls (after 3 warm-up calls) as
rank 0 saw it, and the bandwidth it implies (bytes of the tensor / time).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember.distributed.shm_comm import ShmCommunicator

SIZES = [4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]


def _worker(rank: int, world: int, store: str, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    comm = ShmCommunicator(max_bytes=max(SIZES))
    paths = {"shm": comm.all_reduce, "gloo": dist.all_reduce}
    if rank == 0:
        print(f"{'bytes':>10} {'shm us':>10} {'gloo us':>10} {'shm GB/s':>9} {'gloo GB/s':>9}")
    for size in SIZES:
        tensor = torch.ones(size // 4)
        times = {}
        for name, call in paths.items():
            samples = []
            for i in range(iters + 3):
                dist.barrier()
                start = time.perf_counter()
                call(tensor)
                if i >= 3:
                    samples.append(time.perf_counter() - start)
            times[name] = statistics.median(samples)
        if rank == 0:
            shm, gloo = times["shm"], times["gloo"]
            print(f"{size:>10} {shm * 1e6:>10.1f} {gloo * 1e6:>10.1f} "
                  f"{size / shm / 1e9:>9.2f} {size / gloo / 1e9:>9.2f}", flush=True)  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(
            _worker, args=(args.ranks, f"{tmp}/store", args.iters), nprocs=args.ranks,
            start_method="spawn",
        )  # fmt: skip


if __name__ == "__main__":
    main()

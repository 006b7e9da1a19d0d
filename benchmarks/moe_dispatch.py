"""The two ways data-parallel attention brings a MoE layer's tokens to the experts' ranks,
communication alone: all-gather + reduce-scatter against all-to-all there and back.

    python benchmarks/moe_dispatch.py [--ranks 2] [--iters 50]

Spawned processes, one thread each, ember's shared-memory collectives (the ones
`ember.models.moe` calls). Per shape (hidden size, experts, experts a token) and tokens
per rank, random routing, experts split by expert; the experts' work is left out (each
rank's share is taken as its input rows), so that the times are the dispatch's own.
Median over `--iters` calls of one MoE layer's dispatch as rank 0 saw it (after 3
warm-up calls), and how many rows all-to-all sent per token.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember.distributed.parallel import TPGroup, split
from ember.distributed.shm_comm import ShmCommunicator
from ember.models.moe import send_to_experts

# (hidden, experts, top_k): the 2 GB random Qwen3-MoE of benchmarks/tensor_parallel.py,
# and DeepSeek-V3 / Kimi K2's
SHAPES = [(1024, 32, 8), (7168, 256, 8)]
TOKENS = [1, 4, 16, 64, 256]


def _worker(rank: int, world: int, store: str, iters: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    group = TPGroup(rank, world, ShmCommunicator(max_bytes=64 << 20), True, True)
    if rank == 0:
        print(f"{'hidden':>6} {'experts':>7} {'tokens/rank':>11} {'all-gather us':>13} "
              f"{'all-to-all us':>13} {'a2a rows/token':>14}")  # fmt: skip
    for hidden_size, num_experts, top_k in SHAPES:
        owner = torch.tensor(
            [r for r in range(world) for _ in range(split(num_experts, world, r)[1])]
        )
        for tokens in TOKENS:
            group.rank_tokens = [tokens] * world
            g = torch.Generator().manual_seed(rank)
            hidden = torch.randn(tokens, hidden_size, generator=g)
            ids = torch.rand(tokens, num_experts, generator=g).topk(top_k).indices
            weights = torch.rand(tokens, top_k, generator=g)

            def all_gather(hidden=hidden):
                every = group.gather_rows(hidden)
                return group.reduce_scatter_rows(every)

            def all_to_all(hidden=hidden, weights=weights, ids=ids, owner=owner):
                sent = send_to_experts(group, hidden, weights, ids, owner)
                return sent.combine(sent.hidden)

            times, rows = {}, 0
            for name, call in (("gather", all_gather), ("a2a", all_to_all)):
                samples = []
                for i in range(iters + 3):
                    dist.barrier()
                    start = time.perf_counter()
                    call()
                    if i >= 3:
                        samples.append(time.perf_counter() - start)
                times[name] = statistics.median(samples) * 1e6
            rows = int((owner[ids].unsqueeze(-1) == torch.arange(world)).any(1).sum())
            if rank == 0:
                print(f"{hidden_size:>6} {num_experts:>7} {tokens:>11} {times['gather']:>13.1f} "
                      f"{times['a2a']:>13.1f} {rows / tokens:>14.2f}", flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(args.ranks, f"{tmp}/store", args.iters),
                           nprocs=args.ranks, start_method="spawn")  # fmt: skip


if __name__ == "__main__":
    main()

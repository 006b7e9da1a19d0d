"""Communication among the ranks of one worker (ember.distributed): the shared-memory
all-reduce and all-gather give what Gloo gives, call after call, and leave nothing in
/dev/shm; so do the row collectives of data-parallel attention (rows gathered,
reduce-scattered, sent rank to rank), through shared memory and through Gloo. Two
processes, spawned."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ember.distributed import shm_comm
from ember.distributed.shm_comm import ShmCommunicator

pytestmark = pytest.mark.skipif(not shm_comm.ORDERED_STORES, reason="x86-64 only path")

WORLD = 2


def _init(rank: int, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)


def _value(rank: int, call: int, shape, dtype) -> torch.Tensor:
    """A rank's tensor at a call: distinct on every rank and call."""
    g = torch.Generator().manual_seed(1000 * call + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-1000, 1000, shape, generator=g, dtype=dtype)


CASES = [
    ((1000,), torch.float32),
    ((7, 33), torch.bfloat16),
    ((5,), torch.int64),
    ((), torch.float32),
    ((0, 4), torch.float32),
    ((300, 300), torch.float32),  # 360 KB: over max_bytes, Gloo
]


def _ranks(rank: int, store: str, errors, body) -> None:
    """Rank `rank` running `body(rank)` (a module-level function) in the process group;
    an error is reported to the test."""
    try:
        _init(rank, store)
        body(rank)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        errors.put(f"rank {rank}: {type(e).__name__}: {e}")
        raise


def _spawn(body, tmp_path) -> None:
    """Runs `body` on WORLD spawned ranks; fails the test with a rank's error."""
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    mp.start_processes(
        _ranks, args=(str(tmp_path / "store"), errors, body), nprocs=WORLD, start_method="spawn"
    )
    assert errors.empty(), errors.get()


def _collectives(rank: int) -> None:
    comm = ShmCommunicator(max_bytes=64 << 10)
    assert comm.enabled
    if rank == 1:  # a slow reader: rank 0 must not write over a slot it still reads
        exchange = comm._exchange

        def slow(tensor):
            parts = exchange(tensor)
            time.sleep(0.002)
            return parts

        comm._exchange = slow
    call = 0
    for _ in range(40):  # many calls in a row: a slot reused too early shows
        for shape, dtype in CASES:
            call += 1
            parts = [_value(r, call, shape, dtype) for r in range(WORLD)]
            mine = parts[rank].clone()
            got = comm.all_reduce(mine)
            assert got is mine
            want = parts[0] + parts[1]
            assert torch.equal(got, want), (shape, dtype, call)
            gathered = comm.all_gather(parts[rank])
            rows = [p.reshape(-1, *shape[1:]) for p in parts]
            assert torch.equal(gathered, torch.cat(rows)), (shape, dtype, call)
    # what Gloo gives (its sum of two: the same bits)
    x = _value(rank, 0, (257,), torch.float32)
    y = x.clone()
    dist.all_reduce(x)
    assert torch.equal(comm.all_reduce(y), x)
    assert comm.num_calls > 0


def test_shared_memory_collectives_match_gloo_call_after_call(tmp_path):
    before = set(os.listdir(shm_comm.SHM_DIR))
    _spawn(_collectives, tmp_path)
    left = {n for n in set(os.listdir(shm_comm.SHM_DIR)) - before if n.startswith("ember-comm")}
    assert not left


def _row_collectives(rank: int) -> None:
    shm = ShmCommunicator(max_bytes=64 << 10)
    gloo = ShmCommunicator(max_bytes=64 << 10)
    gloo.enabled = False  # torch.distributed (Gloo) for every call
    call = 0
    # rows per rank (none too), 24 floats a row; 700 x 24 x 4 bytes: over max_bytes
    for counts in ([3, 5], [0, 4], [6, 0], [0, 0], [1, 1], [700, 2]):
        for comm in (shm, gloo):
            call += 1
            parts = [_value(r, call, (counts[r], 24), torch.float32) for r in range(WORLD)]
            got = comm.all_gather_rows(parts[rank], counts)
            assert torch.equal(got, torch.cat(parts)), (counts, comm.enabled)
            full = [_value(r, -call, (sum(counts), 24), torch.float32) for r in range(WORLD)]
            start = sum(counts[:rank])
            want = (full[0] + full[1])[start : start + counts[rank]]
            got = comm.reduce_scatter_rows(full[rank].clone(), counts)
            assert torch.equal(got, want), (counts, comm.enabled)
            # rank s sends splits[s][d] rows to rank d
            splits = [[counts[s] // 2, counts[s] - counts[s] // 2] for s in range(WORLD)]
            max_rows = max(counts)
            got, came = comm.all_to_all_rows(parts[rank], splits[rank], max_rows)
            want = [parts[s][sum(splits[s][:rank]) : sum(splits[s][: rank + 1])]
                    for s in range(WORLD)]  # fmt: skip
            assert came == [len(w) for w in want], (counts, comm.enabled)
            assert torch.equal(got, torch.cat(want)), (counts, comm.enabled)


def test_row_collectives_through_shared_memory_and_gloo(tmp_path):
    _spawn(_row_collectives, tmp_path)

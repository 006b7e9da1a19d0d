"""Load and store bandwidth of each KV tier, against this box's memory and disk speed.

    python benchmarks/kv_tier_bandwidth.py [--blocks 256] [--dir /tmp/kvbw] [--store]

KV tensors in SmolLM2-135M's layout (30 layers x K/V x blocks x 16 tokens x 3 heads x 64,
fp32: 737 KB a block). Saved: the blocks copied out of the pool into host memory (a
memcpy on the engine thread), written to disk files (a background thread) and, with
--store, put into a Mooncake Store (a master and a memory holder started here; run it in
a network namespace: `unshare -rn sh -c 'ip link set lo up && python ...'`). Loaded: the
blocks copied back into the pool from each tier. References: a plain torch copy of the
same bytes, and writing/reading one file of the same size. Disk reads come from the page
cache when the files are that recent (as a reloaded session's usually are).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import time
from pathlib import Path

import torch

from ember.kv.tiers import TieredStore


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def gbps(num_bytes: int, seconds: float) -> str:
    return f"{num_bytes / seconds / 1e9:6.2f} GB/s"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--dir", default="/tmp/kvbw")
    parser.add_argument("--store", action="store_true", help="also a Mooncake Store")
    args = parser.parse_args()
    n = args.blocks
    caches = [torch.randn(2, 2 * n, 16, 3, 64) for _ in range(30)]
    block = sum(c[0, 0].numel() * 4 * 2 for c in caches)
    total = n * block
    print(f"CPU: {cpu_name()}; {n} blocks of {block / 1e3:.0f} KB = {total / 1e6:.0f} MB")

    src = torch.cat([c[:, :n].reshape(-1) for c in caches])
    dst = torch.empty_like(src)
    start = time.perf_counter()
    dst.copy_(src)
    print(f"reference memcpy            {gbps(total, time.perf_counter() - start)}")
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    path = Path(args.dir) / "ref.bin"
    data = src.numpy().tobytes()
    start = time.perf_counter()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    print(f"reference file write+fsync  {gbps(total, time.perf_counter() - start)}")
    start = time.perf_counter()
    path.read_bytes()
    print(f"reference file read (cache) {gbps(total, time.perf_counter() - start)}")

    hashes = [i.to_bytes(16, "little") for i in range(n)]
    saved = list(zip(hashes, range(n), strict=True))
    back = list(zip(hashes, range(n, 2 * n), strict=True))  # into other blocks

    def run(name: str, store: TieredStore, tier: str) -> None:
        start = time.perf_counter()
        store.save(saved)
        copied = time.perf_counter() - start
        store.flush()
        written = time.perf_counter() - start
        if tier != "host" and store.host is not None:
            store.host.slots.clear()  # load from the lower tier
            store.host._free = list(range(store.host.buffer.shape[0]))
        start = time.perf_counter()
        store.load(back).future.result()
        loaded = time.perf_counter() - start
        assert all(torch.equal(c[:, :n], c[:, n:]) for c in caches), "loaded bytes differ"
        for c in caches:
            c[:, n:].zero_()
        print(f"{name:<28}save {gbps(total, copied)} (all written {gbps(total, written)}), "
              f"load {gbps(total, loaded)}")  # fmt: skip
        store.close()

    identity = "bandwidth"
    run("host memory", TieredStore(caches, identity, total + block, None, 0), "host")
    disk = TieredStore(caches, identity, None, args.dir, 4 * total)
    run("disk (no host tier)", disk, "disk")
    if args.store:
        from ember.kv.mooncake import MooncakeStoreTier, store_commands, wait_listening

        master, holder, address = store_commands(3 * total)
        procs = [subprocess.Popen(master, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
        try:
            wait_listening(int(address.rsplit(":", 1)[1]), 30)
            procs.append(subprocess.Popen(holder, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))  # fmt: skip
            wait_listening(int(holder[2].split("=")[1]), 30)
            tier = MooncakeStoreTier(f"mooncake://{address}", b"bandwidth-secret")
            run("Mooncake Store (TCP, MAC)", TieredStore(caches, identity, None, None, 0, tier),
                "cluster")  # fmt: skip
        finally:
            for proc in procs:
                proc.kill()
    shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()

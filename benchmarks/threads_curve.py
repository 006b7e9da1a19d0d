"""Prefill and decode at one thread count, with the cgroup's throttling over the run.

    python benchmarks/threads_curve.py MODEL THREADS

Prints one line: a 512-token prefill (ms), and ms a step for 32-token decodes of 1, 16
and 32 sequences (the median of 3 runs after one), then how often and how long the
process's cgroup was throttled ($CPU_STAT: the cgroup's cpu.stat, by default
/sys/fs/cgroup/cpu.stat; v1's throttled_time is read too) and the process's threads by
name. Run it once per thread count (and inside a cgroup to see a CPU limit's effect).
"""

import collections
import glob
import os
import random
import statistics
import sys
import time

import torch

from ember import LLM, SamplingParams


def throttle() -> tuple[int, int]:
    """(times throttled, microseconds throttled) of this process's cgroup so far."""
    try:
        with open(os.environ.get("CPU_STAT", "/sys/fs/cgroup/cpu.stat")) as f:
            stat = dict(line.split() for line in f)
    except OSError:
        return 0, 0
    usec = int(stat.get("throttled_usec", int(stat.get("throttled_time", 0)) // 1000))
    return int(stat.get("nr_throttled", 0)), usec


def main() -> None:
    torch.set_num_threads(int(sys.argv[2]))
    llm = LLM(sys.argv[1], enable_prefix_caching=False, kv_cache_memory=1 << 30, max_model_len=4096)
    rng = random.Random(0)

    def prompts(n, t):
        return [[rng.randrange(1000, 40000) for _ in range(t)] for _ in range(n)]

    before = throttle()
    out = [f"{os.path.basename(sys.argv[1])} threads {torch.get_num_threads()}"]
    cases = {"prefill 1x512": (1, 512, 1), "decode 1x32": (1, 16, 32),
             "decode 16x32": (16, 16, 32), "decode 32x32": (32, 16, 32)}  # fmt: skip
    for case, (n, t, m) in cases.items():
        params = SamplingParams(temperature=0, max_tokens=m, ignore_eos=True)
        llm.generate(prompts(n, t), params)
        times = []
        for _ in range(3):
            p = prompts(n, t)
            start = time.perf_counter()
            llm.generate(p, params)
            times.append(time.perf_counter() - start)
        per = statistics.median(times) * 1e3 / m
        out.append(f"{case} {per:.1f} ms{'/step' if m > 1 else ''}")
    after = throttle()
    out.append(f"throttled {after[0] - before[0]} times, {(after[1] - before[1]) / 1e3:.0f} ms")
    names = collections.Counter(open(f).read().strip() for f in glob.glob("/proc/self/task/*/comm"))
    out.append(f"threads by name {dict(names)}")
    print(", ".join(out), flush=True)


if __name__ == "__main__":
    main()

"""How many CPUs this process may keep busy: the cores it may run on (its affinity) and
the CPU time its cgroups allow (a container's CPU limit).

torch sizes its thread pool from the affinity alone, so in a container limited to 4 CPUs
on a 64-core node it runs 64 threads, which spend the quota in a fraction of each period
and then all wait, throttled, for the next: every parallel region waits on the threads
descheduled. Measured on the 2-core dev box in a cgroup of one CPU (cpu.cfs_quota_us =
cpu.cfs_period_us), the default model took 1.4-1.7x as long on two threads as on one
(docs/benchmarks.md). The engine therefore runs no more threads than `usable_cpus()`.

cgroup v2 keeps the limit in `cpu.max` ("QUOTA PERIOD", or "max PERIOD"), v1 in
`cpu.cfs_quota_us` / `cpu.cfs_period_us` (-1: none); a limit on any ancestor cgroup binds
too, so the tightest one on the way up counts.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger("ember.engine")

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(proc_cgroup: Path = PROC_CGROUP, root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time a period the process's cgroups allow (2.5: two and a half
    CPUs), the tightest over its cgroup and their ancestors, v1 or v2; None where none is
    set or none can be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: "0::/path"
            mount = root if (root / "cgroup.controllers").is_file() else root / "unified"
            limits.append(_tightest(mount, path, _v2_limit))
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            for mount in _v1_mounts(root):
                limits.append(_tightest(mount, path, _v1_limit))
    found = [x for x in limits if x is not None]
    return min(found) if found else None


def usable_cpus() -> int:
    """The threads this process can keep busy: its cores, no more than its cgroups' CPU
    limit (rounded down, at least 1)."""
    return _within(cgroup_cpu_limit())


def _within(limit: float | None) -> int:
    cores = len(os.sched_getaffinity(0))
    return cores if limit is None else max(1, min(cores, math.floor(limit)))


def fit_torch_threads() -> int:
    """Lowers torch's thread count to what the cgroup's CPU limit allows (`usable_cpus()`;
    never raises it; left alone without a limit or where $OMP_NUM_THREADS says how
    many); returns the count in use."""
    import torch

    threads = torch.get_num_threads()
    limit = None if os.environ.get("OMP_NUM_THREADS") else cgroup_cpu_limit()
    if limit is None:  # a count set by hand, or no limit: torch's choice stands
        return threads
    usable = _within(limit)
    if threads > usable:
        logger.info(
            "%d torch threads, not %d: this process's cgroup allows %g CPUs (its CPU limit)",
            usable, threads, limit,
        )  # fmt: skip
        torch.set_num_threads(usable)
        return usable
    return threads


def _v1_mounts(root: Path) -> list[Path]:
    """The v1 hierarchies that hold the cpu controller ("cpu", "cpu,cpuacct", ...)."""
    try:
        return [
            d
            for d in sorted(root.iterdir())
            if "cpu" in d.name.split(",") and (d / "cpu.cfs_quota_us").is_file()
        ]
    except OSError:
        return []


def _tightest(mount: Path, path: str, read) -> float | None:
    """The smallest limit `read(dir)` gives from the process's cgroup up to the mount. In
    a cgroup namespace (a container) the path shown is "/" and the mount is the
    container's own cgroup; elsewhere the path leads from the mount to it."""
    start = mount / path.lstrip("/")
    here = start if start.is_dir() else mount
    found = []
    while True:
        limit = read(here)
        if limit is not None:
            found.append(limit)
        if here == mount or mount not in here.parents:
            break
        here = here.parent
    return min(found) if found else None


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _ratio(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota < 0 else _ratio(quota, period)


def _ratio(quota: int, period: int) -> float | None:
    return quota / period if quota > 0 and period > 0 else None

"""How many threads the engine runs: its cores, within its cgroup's CPU limit (ember.cpus)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from ember import cpus
from ember.distributed import executor
from ember.llm import LLM


def cgroup_files(tmp_path: Path, lines: str, files: dict[str, str]) -> tuple[Path, Path]:
    """A fake /proc/self/cgroup (`lines`) and cgroup mount (`files`: path -> text)."""
    proc = tmp_path / "proc_cgroup"
    proc.write_text(lines)
    root = tmp_path / "sys_fs_cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return proc, root


def test_v2_limit_is_the_tightest_on_the_way_up(tmp_path: Path) -> None:
    proc, root = cgroup_files(tmp_path, "0::/kubepods.slice/pod/ctr\n", {
        "cgroup.controllers": "cpu memory",
        "kubepods.slice/pod/ctr/cpu.max": "250000 100000",
        "kubepods.slice/pod/cpu.max": "150000 100000",
        "kubepods.slice/cpu.max": "max 100000",
        "cpu.max": "max 100000",
    })  # fmt: skip
    assert cpus.cgroup_cpu_limit(proc, root) == 1.5


def test_v2_without_a_limit_or_inside_a_namespace(tmp_path: Path) -> None:
    proc, root = cgroup_files(tmp_path, "0::/\n", {
        "cgroup.controllers": "cpu", "cpu.max": "max 100000",
    })  # fmt: skip
    assert cpus.cgroup_cpu_limit(proc, root) is None
    # a container's own cgroup is the mount's root, its path shown as "/"
    (root / "cpu.max").write_text("400000 100000\n")
    assert cpus.cgroup_cpu_limit(proc, root) == 4.0


def test_v1_quota_over_period_on_a_hybrid_host(tmp_path: Path) -> None:
    """v1's cpu controller beside a v2 hierarchy without it (this box's layout)."""
    proc, root = cgroup_files(
        tmp_path,
        "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n0::/\n",
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000",
            "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
            "unified/cgroup.procs": "",
        },
    )
    assert cpus.cgroup_cpu_limit(proc, root) == 0.5
    (root / "cpu,cpuacct/docker/abc/cpu.cfs_quota_us").write_text("-1\n")
    assert cpus.cgroup_cpu_limit(proc, root) is None


@pytest.mark.parametrize("text", ["", "garbage", "1:cpu", "0::/gone\n"])
def test_nothing_readable_is_no_limit(tmp_path: Path, text: str) -> None:
    proc, root = cgroup_files(tmp_path, text, {"cpu.max": "nonsense"})
    assert cpus.cgroup_cpu_limit(proc, root) is None
    assert cpus.cgroup_cpu_limit(tmp_path / "missing", root) is None


@pytest.mark.parametrize(
    ("cores", "limit", "usable"),
    [(64, 4.0, 4), (64, 2.5, 2), (64, 0.3, 1), (2, 8.0, 2), (8, None, 8)],
)
def test_usable_cpus_rounds_the_limit_down_within_the_cores(
    monkeypatch, cores: int, limit: float | None, usable: int
) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: limit)
    assert cpus.usable_cpus() == usable


@pytest.fixture
def threads():
    """torch's thread count, put back after the test."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_the_engine_runs_no_more_threads_than_its_cgroup_allows(
    tiny_checkpoint, monkeypatch, threads
) -> None:
    if threads < 2:
        pytest.skip("needs two threads to lower")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 1.0)
    LLM(str(tiny_checkpoint()), kv_cache_memory=1 << 24)
    assert torch.get_num_threads() == 1
    # ranks of one host split what the limit allows
    assert executor.rank_threads(2, 0) == executor.rank_threads(2, 1) == 1


def test_an_explicit_thread_count_is_left_alone(monkeypatch, threads) -> None:
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 1.0)
    monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
    assert cpus.fit_torch_threads() == threads == torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    assert cpus.fit_torch_threads() == threads  # never raised, nor lowered without a limit


def _writable_v1_cpu_cgroup() -> Path | None:
    mount = cpus.CGROUP_ROOT / "cpu"
    if not (mount / "cpu.cfs_quota_us").is_file() or not os.access(mount, os.W_OK):
        return None
    return mount


@pytest.mark.skipif(_writable_v1_cpu_cgroup() is None, reason="no writable v1 cpu cgroup here")
def test_a_process_in_a_real_cgroup_of_one_cpu_sees_one() -> None:
    """The kernel's own files: a child cgroup with a quota of one CPU a period."""
    group = _writable_v1_cpu_cgroup() / f"ember-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "cpu.cfs_quota_us").write_text(str(int((group / "cpu.cfs_period_us").read_text())))
        script = (
            f"open({str(group / 'cgroup.procs')!r}, 'w').write(str(__import__('os').getpid()))\n"
            "from ember import cpus\n"
            "print(cpus.cgroup_cpu_limit(), cpus.usable_cpus())\n"
        )
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["1.0", "1"]
    finally:
        group.rmdir()


def test_pinned_workers_split_the_cores_the_limit_allows(monkeypatch) -> None:
    """`ember up --pin`: two workers in a container of 4 CPUs on 16 cores get 2 cores each,
    so their threads together stay within the limit."""
    from ember.router.up import core_sets

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 4.0)
    assert core_sets(2) == [{0, 1}, {2, 3}]
    monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: None)
    assert core_sets(2) == [set(range(8)), set(range(8, 16))]
    with pytest.raises(ValueError, match="5 workers but only 4 cores"):
        monkeypatch.setattr(cpus, "cgroup_cpu_limit", lambda: 4.0)
        core_sets(5)

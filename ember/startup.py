"""Where a start's seconds go: each process marks the end of its start-up phases.

`mark(phase)` records when a phase of this process ended: the wall clock, and the CPU
time the process had used by then (which other processes on a busy machine do not
inflate). `marks()` gives them in order, led by ("start", the time the OS started the
process, 0.0). In `ember serve` the engine core sends its marks with `EngineReady`, and
the API process shows both processes' on one clock, as seconds since it began: one log
line when it is ready, and `ember_startup_seconds` / `ember_startup_cpu_seconds`
`{process, phase}` in /metrics (`ember bench startup` reads them).

    api   start | args | core configured | server imported | tokenizer | core ready | http
    core    start | imports | model built | weights | packed | kv cache | ready

A phase's cost is the time since the previous mark of the same process; the two
processes overlap, so only the API's last mark is the start's wall time.

Python's cyclic garbage collector is held off while a server process starts
(`hold_collector`, `release_collector`): importing torch and the HTTP stack makes a few
hundred thousand objects that live as long as the process, and the collections that
their allocation set off took 0.15-0.2 s of the engine core's imports (1.22 against 1.37
s, 2-core EPYC). Released, those objects are frozen (`gc.freeze`): the first full
collection while serving, which came within seconds of a start, walked them for 120-170
ms in the engine core (a stall of the step loop) and 100-110 ms in the API process,
0.1-1 ms once frozen. Objects made later are collected as before.
"""

from __future__ import annotations

import gc
import os
import time

Mark = tuple[str, float, float]  # (phase, wall-clock end, CPU seconds used by then)

_marks: list[Mark] = []
_IMPORTED = time.time()


def process_start_time() -> float:
    """Wall-clock time at which the OS started this process (Linux, 10 ms resolution);
    elsewhere the time this module was first imported."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        started_after_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22, starttime
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started_after_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return _IMPORTED


def mark(phase: str) -> None:
    """Records that `phase` of this process's start ended now."""
    _marks.append((phase, time.time(), time.process_time()))


def marks() -> list[Mark]:
    """("start", process start, 0.0), then every phase marked so far."""
    return [("start", process_start_time(), 0.0), *_marks]


def relative(phases: list[Mark], origin: float) -> list[Mark]:
    """The same phases with their ends as seconds since `origin` (a wall-clock time)."""
    return [(phase, at - origin, cpu) for phase, at, cpu in phases]


def summary(processes: dict[str, list[Mark]]) -> str:
    """One line: per process, each phase with the wall seconds it took (`phase +took`)."""
    parts = []
    for process, phases in processes.items():
        steps = [
            f"{phase} +{at - before:.2f}"
            for (_, before, _), (phase, at, _) in zip(phases, phases[1:], strict=False)
        ]
        parts.append(f"{process}: " + ", ".join(steps))
    return "; ".join(parts)


def hold_collector() -> None:
    """Turns the cyclic collector off for the rest of this process's start (the module
    docstring); `release_collector` turns it on again."""
    gc.disable()


def release_collector() -> None:
    """Moves every object the start made out of the collector's sight, then turns it
    on (again)."""
    gc.freeze()
    gc.enable()

"""ember's own CPU kernels, compiled on first use with torch's C++ extension tooling.

One build per instruction set (`ISA_FLAGS`): AVX-512 (x86-64-v4), AVX2 with FMA and
F16C (x86-64-v3), and `generic` (the compiler's baseline: SSE2 on x86-64, NEON on
ARM); the same sources, written against simd.h. Which one runs is decided at run time
from the CPU's feature flags, never by the machine that built it, so a build directory
may be shared by any machines; $EMBER_CPU_ISA forces one (`ember.envs.cpu_isa`).

Builds go to ~/.cache/ember/kernels/<isa>-<key> (the key hashes this directory's path,
the sources and the flags: two checkouts sharing one build directory would rebuild each
other's, since ninja sees the source paths change). A finished build leaves a stamp, and
later processes load its shared object directly, without the build tooling. When a
compiler is missing or the build fails, callers fall back to plain torch ops.

Builds of one directory take turns under an flock, which the kernel releases when its
holder dies; torch's own lock file (which a killed build leaves behind, and every later
build would wait on for ever) is removed while that flock is held.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import logging
import platform
import time
from pathlib import Path

from ember import envs

logger = logging.getLogger("ember.engine")

_HERE = Path(__file__).parent
_SOURCES = (
    "bindings.cpp",
    "paged_attention.cpp",
    "prefill_attention.cpp",
    "layers.cpp",
    "decode_layer.cpp",
    "small_gemm.cpp",
    "block_gemm.cpp",
    "int8_tiles.cpp",
)
_HEADERS = (
    "kernels.h",
    "simd.h",
    "cache_types.h",
    "padded_rows.h",
    "int8_rows.h",
    "work_chunks.h",
    "int8_tiles.inc",
    "prefill_bf16_tile.inc",
    "prefill_amx_tile.inc",
)
_CFLAGS = ["-O3", "-fopenmp", "-fvisibility=hidden"]
ISA_FLAGS = {
    "avx512": ["-march=x86-64-v4", "-mtune=icelake-server"],  # measured: generic tuning 10% slower
    "avx2": ["-march=x86-64-v3", "-mtune=generic"],
    "generic": [],
}
# what each x86 build's instructions need, as /proc/cpuinfo names the features
_AVX2_NEEDS = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_X86_NEEDS = {
    "avx512": _AVX2_NEEDS | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
    "avx2": _AVX2_NEEDS,
}
_STAMP = "ember-built"


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo lists them (empty where it cannot be read)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return frozenset()
    for line in lines:
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def supported_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The kernel builds this CPU can run, fastest first (`generic` always)."""
    flags = cpu_flags() if flags is None else flags
    if not _is_x86():
        return ["generic"]
    return [isa for isa, needs in _X86_NEEDS.items() if needs <= flags] + ["generic"]


@functools.cache
def selected_isa() -> str:
    """$EMBER_CPU_ISA when set (ValueError if this CPU cannot run it), else the fastest;
    read once per process (tests that change it call `selected_isa.cache_clear()`)."""
    forced, runnable = envs.cpu_isa(), supported_isas()
    if forced is None:
        return runnable[0]
    if forced not in runnable:
        missing = sorted(_X86_NEEDS[forced] - cpu_flags()) if _is_x86() else ["x86-64"]
        raise ValueError(
            f"EMBER_CPU_ISA={forced}: this CPU cannot run it (it lacks {', '.join(missing)}); "
            f"it runs {', '.join(runnable)}"
        )
    return forced


@functools.cache
def _build_key(isa: str) -> str:
    digest = hashlib.sha256(str(_HERE).encode())
    digest.update(" ".join(_CFLAGS + ISA_FLAGS[isa]).encode())
    for name in _SOURCES + _HEADERS:
        digest.update((_HERE / name).read_bytes())
    return digest.hexdigest()[:16]


def _build_directory(isa: str) -> Path:
    path = envs.cache_dir() / "kernels" / f"{isa}-{_build_key(isa)}"
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def _build_turn(build_directory: Path):
    """Holds the directory's build flock; clears a lock file a killed build left behind."""
    with open(build_directory / "ember-build.flock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        stale = build_directory / "lock"  # torch's FileBaton: ours held, so nobody's
        if stale.exists():
            logger.warning("removing %s, left by a build that was stopped", stale)
            stale.unlink(missing_ok=True)
        yield


def cpu_kernels(isa: str | None = None):
    """The compiled module for `isa` (default: `selected_isa()`), or None when it cannot
    be built here. Its `isa` attribute names the build."""
    return _kernels(isa or selected_isa())


def built_cpu_kernels():
    """`cpu_kernels()` where its build is loaded or finished already, else None (never a
    compile): for callers that want the kernels only at no cost, such as the GGUF loader,
    which runs for models on a GPU too."""
    isa = selected_isa()
    if isa in _asked or (_build_directory(isa) / _STAMP).exists():
        return _kernels(isa)
    return None


_asked: set[str] = set()  # the builds this process has loaded or tried


@functools.cache
def _kernels(isa: str):
    _asked.add(isa)
    name = f"ember_cpu_kernels_{isa}"
    try:
        start = time.perf_counter()
        build_directory = _build_directory(isa)
        stamp = build_directory / _STAMP
        if stamp.exists():  # a finished build of exactly these sources and flags
            module = _load_built(name, build_directory / stamp.read_text().strip())
        else:
            module = _build(name, isa, build_directory)
            stamp.write_text(Path(module.__file__).name)
        logger.info("CPU kernels: the %s build, ready in %.2f s", isa, time.perf_counter() - start)
        return module
    except Exception as exc:  # no compiler, no ninja, build error: use torch ops
        logger.warning("CPU kernels (%s) unavailable (%s); using torch ops", isa, exc)
        return None


def _build(name: str, isa: str, build_directory: Path):
    from torch.utils.cpp_extension import load

    with _build_turn(build_directory):
        return load(
            name=name,
            sources=[str(_HERE / source) for source in _SOURCES],
            build_directory=str(build_directory),
            extra_cflags=_CFLAGS + ISA_FLAGS[isa],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def _load_built(name: str, path: Path):
    import torch  # noqa: F401  (the module links against libtorch: load that first)

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

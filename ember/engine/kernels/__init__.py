"""ember's own CPU kernels, compiled on first use with torch's C++ extension tooling.

Built once per checkout and source version into ~/.cache/ember/kernels/<key> (the key
hashes this directory's path and the sources: two checkouts sharing one build directory
would rebuild each other's, since ninja sees the source paths change); when a compiler
is missing or the build fails, callers fall back to plain torch ops.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import time
from pathlib import Path

logger = logging.getLogger("ember.engine")

_HERE = Path(__file__).parent
_SOURCES = (
    "paged_attention.cpp",
    "layers.cpp",
    "decode_layer.cpp",
    "small_gemm.cpp",
    "block_gemm.cpp",
)
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]


def _build_directory() -> Path:
    from ember import envs

    digest = hashlib.sha256(str(_HERE).encode() + " ".join(_CFLAGS).encode())
    for name in _SOURCES:
        digest.update((_HERE / name).read_bytes())
    path = envs.cache_dir() / "kernels" / digest.hexdigest()[:16]
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def cpu_kernels():
    """The compiled module, or None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        module = load(
            name="ember_cpu_kernels",
            sources=[str(_HERE / name) for name in _SOURCES],
            build_directory=str(_build_directory()),
            extra_cflags=_CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        logger.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
        return module
    except Exception as exc:  # no compiler, no ninja, build error: use torch ops
        logger.warning("CPU kernels unavailable (%s); using torch SDPA for decode", exc)
        return None

"""ember's own CPU kernels, compiled on first use with torch's C++ extension tooling.

Built once per machine into torch's extension cache (~/.cache/torch_extensions); when a
compiler is missing or the build fails, callers fall back to plain torch ops.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

logger = logging.getLogger("ember.engine")

_HERE = Path(__file__).parent
_SOURCES = ("paged_attention.cpp", "layers.cpp", "decode_layer.cpp", "small_gemm.cpp")


@functools.cache
def cpu_kernels():
    """The compiled module, or None when it cannot be built here."""
    try:
        from torch.utils.cpp_extension import load

        start = time.perf_counter()
        module = load(
            name="ember_cpu_kernels",
            sources=[str(_HERE / name) for name in _SOURCES],
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
        logger.info("CPU kernels ready in %.1f s", time.perf_counter() - start)
        return module
    except Exception as exc:  # no compiler, no ninja, build error: use torch ops
        logger.warning("CPU kernels unavailable (%s); using torch SDPA for decode", exc)
        return None

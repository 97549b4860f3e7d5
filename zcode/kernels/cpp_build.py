"""Builds a C++ source file of torch ops (TORCH_LIBRARY / _FRAGMENT) once per machine and loads it.

torch.utils.cpp_extension caches the build under $TORCH_EXTENSIONS_DIR and rebuilds it when the
source or the flags change. -march=native for the machine's vector ISA, -fopenmp
because at::parallel_for is OpenMP pragmas in ATen's headers (without it every call runs on one
thread).
"""

import logging
from pathlib import Path

logger = logging.getLogger(__name__)


def build_ops(name: str, source: Path, what: str, extra_cflags: tuple[str, ...] = ()) -> bool:
    """True when `source` built and loaded (its ops are then in torch.ops); False, with a
    warning naming `what` falls back, where the compiler or the ISA is missing."""
    from torch.utils.cpp_extension import load

    try:
        load(
            name=name,
            sources=[str(source)],
            extra_cflags=["-O3", "-march=native", "-fopenmp", *extra_cflags],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as e:  # no compiler or no AVX-512: an expected state
        logger.warning("C++ kernels %s unavailable, %s: %s", source.name, what, e)
        return False
    return True

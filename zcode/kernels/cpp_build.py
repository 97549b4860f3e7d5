"""Builds a C++ source file of torch ops (TORCH_LIBRARY / _FRAGMENT) once per machine and loads it.

torch.utils.cpp_extension caches the build under $TORCH_EXTENSIONS_DIR and rebuilds it when the
source or the flags change. -march=native for the machine's vector ISA, -fopenmp
because at::parallel_for is OpenMP pragmas in ATen's headers (without it every call runs on one
thread).

Each source picks its code path per op from the compiler's target macros, so every file builds on
any CPU (and on aarch64), fast where the ISA exists:
- ggml.cpp: AVX-512 F/BW/VL + VNNI (+ F16C), or AVX2 + FMA + F16C; otherwise portable loops gcc
  vectorizes.
- gemv.cpp: fp32 and bf16 by float_dot.h (AVX-512 F/BW/VL, vdpbf16ps with AVX512_BF16; AVX2 +
  FMA), W4A8 / W8A8 with AVX512_VNNI; each op without its features takes its portable loops.
- moe.cpp: float_dot.h's dot products, SiLU in AVX-512 or AVX2 vectors; otherwise portable loops.
- attention.cpp: AVX-512 F/BW/VL or AVX2 + FMA (fp32 and bf16 caches); otherwise portable loops.
The portable loops do the same integer dot products exactly and sum fp32 in another order.

`python -m zcode.kernels` builds every source now (`make install` runs it), so neither
a first request nor a test waits tens of seconds, or minutes on a busy machine, for a compiler.

torch serializes builds of one extension with a `lock` file it deletes when done; a process
killed mid-build leaves it behind and every later build waits on it forever. zcode's builds
therefore take an flock first (the kernel releases it when its holder dies): whoever holds it is
the only zcode build of that extension, so a torch `lock` file it finds is stale and goes.
"""

import contextlib
import fcntl
import hashlib
import logging
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)


def build_ops(name: str, source: Path, what: str, extra_cflags: tuple[str, ...] = ()) -> bool:
    """True when `source` built and loaded (its ops are then in torch.ops); False, with a
    warning naming `what` falls back, where the compiler or the ISA is missing.

    The build is filed under `name` and a digest of the source, the shared headers beside it
    (simd.h) and the flags, and compiles copies of them kept in its build directory: ninja
    rebuilds whenever a source's path changes, so two checkouts (a test clone beside a working
    tree) building from their own paths would rebuild each other's kernels at every start,
    while changed sources never share a build."""
    from torch.utils.cpp_extension import load

    cflags = ["-O3", "-march=native", "-fopenmp", *extra_cflags]
    code = source.read_bytes()
    headers = {path.name: path.read_bytes() for path in sorted(source.parent.glob("*.h"))}
    digest = hashlib.sha256(code + b"".join(headers.values()) + "\0".join(cflags).encode())
    name = f"{name}_{digest.hexdigest()[:12]}"
    try:
        with build_lock(name) as build_dir:
            for file_name, text in [(source.name, code), *headers.items()]:
                copy = build_dir / file_name  # headers beside the copy: #include "simd.h"
                if not copy.exists() or copy.read_bytes() != text:
                    copy.write_bytes(text)
            load(
                name=name,
                sources=[str(build_dir / source.name)],
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
            )
    except Exception as e:  # no working C++ compiler: an expected state on some machines
        logger.warning("C++ kernels %s unavailable, %s: %s", source.name, what, e)
        return False
    return True


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[Path]:
    """Held while extension `name` builds or loads (yields its build directory); clears a dead
    build's torch lock file."""
    from torch.utils.cpp_extension import _get_build_directory  # the dir torch builds `name` in

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "zcode-build.flock", "w") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        stale = build_dir / "lock"
        if stale.exists():
            logger.warning("removing %s, left by a build that was killed", stale)
            stale.unlink(missing_ok=True)
        yield build_dir


def build_all() -> dict[str, bool]:
    """Builds (or loads the cached builds of) every C++ kernel source: {name: built}."""
    from zcode.kernels import gemv, ggml, moe, paged_attention
    from zcode.sparsity import kernel as sparse_rows

    return {
        "gemv": gemv.available(),
        "attention": paged_attention.available(),
        "ggml": ggml.available(),
        "moe": moe.fused_available(),
        "sparse_rows": sparse_rows.available(),
    }


def describe(built: dict[str, bool]) -> str:
    return ", ".join(f"{name} {'ready' if ok else 'unavailable'}" for name, ok in built.items())

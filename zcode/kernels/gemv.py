"""Decode GEMV kernels in C++ (gemv.cpp: AVX-512 BF16 + VNNI), registered as torch ops.

At decode a linear layer multiplies one to a few rows by the whole weight, so it is bound by
reading the weight. torch's bf16 F.linear at one row reads ~2x slower than fp32 on this CPU, and
its int4 kernel is compute-bound; these kernels stream each weight row once per call:
- `torch.ops.zcode.gemv_bf16(x, w)`: bf16 weight, activations rounded to bf16, fp32 sums;
- `torch.ops.zcode.gemv_f32(x, w)`: fp32 weight and activations;
- `torch.ops.zcode.gemv_w4a8(x, qweight, row_scales_and_zeros, group, out_features, min_scale)`:
  zcode.quant.int4's W4A8 format, x quantized per token to int8 inside the call, exact integer
  dot products;
- `torch.ops.zcode.gemv_w8a8(x, qweight, scales, row_sums, min_scale)`: zcode.quant.int8's W8A8
  format, likewise.
All take 1 to MAX_ROWS rows and return fp32. They are registered with the dispatcher from C++
(no Python per call) and have fake kernels here, so torch.compile keeps each as one call in a
compiled decode graph.

Built once with torch.utils.cpp_extension.load and -march=native (cached by torch under
$TORCH_EXTENSIONS_DIR); `available()` is False where the ISA or the compiler is missing, and the
callers keep torch's kernels.
"""

import functools
import logging
from pathlib import Path

import torch

from zcode.quant.formats import GEMV_MAX_ROWS

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("gemv.cpp")
MAX_ROWS = GEMV_MAX_ROWS


@functools.cache
def available() -> bool:
    """True when the kernels build and load here (built on first call); then torch.ops.zcode
    has them."""
    from torch.utils.cpp_extension import load

    try:
        load(
            name="zcode_gemv_v1",
            sources=[str(SOURCE)],
            # -fopenmp: at::parallel_for is OpenMP pragmas in ATen's headers; without it every
            # call would run on one thread.
            extra_cflags=["-O3", "-march=native", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
        )
    except Exception as e:  # no compiler or no AVX-512 BF16/VNNI: an expected state
        logger.warning("C++ GEMV kernels unavailable, using torch's: %s", e)
        return False
    _register_fakes()
    return True


def gemv_bf16(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: [M, K] float, w: [N, K] bf16 contiguous -> [M, N] fp32; M <= MAX_ROWS."""
    return torch.ops.zcode.gemv_bf16(x, w)


def gemv_w4a8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    row_scales_and_zeros: torch.Tensor,
    group_size: int,
    out_features: int,
    min_scale: float,
) -> torch.Tensor:
    """x: [M, K_in] float; qweight: uint8 [N_pad, K / 2]; row_scales_and_zeros: bf16
    [N_pad, K / group, 2] -> [M, out_features] fp32; M <= MAX_ROWS."""
    return torch.ops.zcode.gemv_w4a8(
        x, qweight, row_scales_and_zeros, group_size, out_features, min_scale
    )


def _register_fakes() -> None:
    # Output shapes for tracing (torch.compile): the kernels themselves never run on fakes.
    @torch.library.register_fake("zcode::gemv_bf16")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)

    @torch.library.register_fake("zcode::gemv_f32")
    def _(x, w):
        return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32)

    @torch.library.register_fake("zcode::gemv_w4a8")
    def _(x, qweight, row_scales_and_zeros, group, out_features, min_scale):
        return x.new_empty(x.shape[0], out_features, dtype=torch.float32)

    @torch.library.register_fake("zcode::gemv_w8a8")
    def _(x, qweight, scales, row_sums, min_scale):
        return x.new_empty(x.shape[0], qweight.shape[0], dtype=torch.float32)

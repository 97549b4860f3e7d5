"""Decode GEMV kernels in C++ (gemv.cpp: AVX-512 BF16 + VNNI, or portable loops), as torch ops.

At decode a linear layer multiplies one to a few rows by the whole weight, so it is bound by
reading the weight. torch's bf16 F.linear at one row reads ~2x slower than fp32 on this CPU, and
its int4 kernel is compute-bound; these kernels stream each weight row once per call:
- `torch.ops.zcode.gemv_bf16(x, ws)`: bf16 weights, activations rounded to bf16, fp32 sums;
- `torch.ops.zcode.gemv_f32(x, ws)`: fp32 weights and activations;
- `torch.ops.zcode.gemv_w4a8(x, qweights, row_scales_and_zeros, group, out_features, min_scale)`:
  zcode.quant.int4's W4A8 format, x quantized per token to int8 inside the call, exact integer
  dot products;
- `torch.ops.zcode.gemv_w8a8(x, qweights, scales, row_sums, min_scale)`: zcode.quant.int8's W8A8
  format, likewise.
Each takes a list of weights that share the input and returns their outputs side by side,
[M, N_0 + N_1 + ...] fp32 (zcode.layers.linear.linear_group: q/k/v or gate/up in one call), for 1
to MAX_ROWS rows (bf16 and fp32: zcode.quant.formats.FLOAT_GEMV_MAX_ROWS, 4 rows at a time).
They are registered with the dispatcher from C++ (no Python per call) and have fake kernels here,
so torch.compile keeps each as one call in a compiled decode graph.

Built once with torch.utils.cpp_extension.load and -march=native (cached by torch under
$TORCH_EXTENSIONS_DIR); each op has a portable path for CPUs without its AVX-512 features, so
`available()` is False only where no C++ compiler works, and the callers keep torch's kernels.
"""

import functools
from pathlib import Path

import torch

from zcode.kernels.cpp_build import build_ops
from zcode.quant.formats import GEMV_MAX_ROWS

SOURCE = Path(__file__).with_name("gemv.cpp")
MAX_ROWS = GEMV_MAX_ROWS


@functools.cache
def available() -> bool:
    """True when the kernels build and load here (built on first call); then torch.ops.zcode
    has them."""
    if not build_ops("zcode_gemv", SOURCE, "using torch's"):
        return False
    _register_fakes()
    return True


def _register_fakes() -> None:
    # Output shapes for tracing (torch.compile): the kernels themselves never run on fakes.
    def side_by_side(x, num_rows):
        return x.new_empty(x.shape[0], sum(num_rows), dtype=torch.float32)

    @torch.library.register_fake("zcode::gemv_bf16")
    def _(x, ws):
        return side_by_side(x, [w.shape[0] for w in ws])

    @torch.library.register_fake("zcode::gemv_f32")
    def _(x, ws):
        return side_by_side(x, [w.shape[0] for w in ws])

    @torch.library.register_fake("zcode::gemv_w4a8")
    def _(x, qweights, row_scales_and_zeros, group, out_features, min_scale):
        return side_by_side(x, out_features)

    @torch.library.register_fake("zcode::gemv_w8a8")
    def _(x, qweights, scales, row_sums, min_scale):
        return side_by_side(x, [q.shape[0] for q in qweights])

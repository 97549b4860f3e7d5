"""Op `linear`: x [M, K] @ W.T for a weight in any packed format (zcode.quant).

Reference: the format's own `linear_reference` (dequantize, fp32 F.linear; float64 for A8).
CPU variants: the format's `linear_fast` (its hand-set row threshold between kernels), and for
the weight-only int formats each of the two kernels alone, so the autotuner finds the crossover
on this machine per shape instead of the thresholds measured once on another; for bf16 and W4A8
at decode row counts the C++ GEMV (zcode.kernels.gemv), W4A8 on torch's int4 kernels and W8A8
on torch._int_mm at any row count; for GGUF weights (zcode.quant.gguf) the C++ GEMV and the
C++ dequantize + fp32 GEMM at any count (zcode.kernels.ggml).
"""

import torch

from zcode.kernels.registry import define_op, register
from zcode.quant.formats import Bf16Weight, PackedWeight, gemv_available
from zcode.quant.gguf import (
    ACTIVATION_BLOCK,
    INTERLEAVED_TYPES,
    GgufWeight,
    ggml_available,
    interleaving_pays,
    type_name,
)
from zcode.quant.gguf import KERNEL_TYPES as GGUF_KERNEL_TYPES
from zcode.quant.int4 import Int4Weight, W4A8Weight
from zcode.quant.int8 import Int8Weight, W8A8Weight

ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOL = 2**-5  # elementwise, in units of ||x_m|| ||w_n|| / sqrt(K): see tests/test_quant_kernels.py
OUTPUT_RTOL = 2**-7
EXACT_FORMATS = ("W8A8Weight",)


def reference(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    # x: [M, K] -> [M, N] fp32
    return packed.linear_reference(x)


def shape_class(packed: PackedWeight, x: torch.Tensor) -> str:
    rows = next((b for b in ROW_BUCKETS if x.shape[0] <= b), "many")
    group = getattr(packed, "group_size", "") or getattr(packed, "type_name", "")
    return (
        f"{type(packed).__name__}{group}|N{packed.out_features}xK{packed.in_features}"
        f"|rows<={rows}|{str(x.dtype).removeprefix('torch.')}"
    )


def tolerance(packed: PackedWeight, x: torch.Tensor) -> tuple[float, float]:
    """(rtol, atol): W8A8 is exact up to fp32. The bf16-activation kernels round inputs (the
    atol: the typical size of a sum of K rounding errors, for the worst row pair) and may round
    the output to bf16 (the rtol: 2^-9 relative, with margin; large outputs of real models'
    correlated activations exceed the atol alone). GGUF weights: the reference quantizes x as
    the kernels do, so only fp32 rounding (of sums of up to K products) separates them."""
    if isinstance(packed, GgufWeight):
        ref_scale = float(x.float().abs().max()) * float(packed.dequantize().abs().sum(1).max())
        return 1e-5, 1e-5 * ref_scale
    if type(packed).__name__ in EXACT_FORMATS:
        return 1e-5, 1e-5 * float(x.abs().max()) * packed.in_features**0.5
    w_norm = packed.dequantize().norm(dim=1).max()
    return OUTPUT_RTOL, TOL * float(x.float().norm(dim=1).max() * w_norm) / packed.in_features**0.5


def cases() -> list:
    from zcode.quant.linear import FORMATS, quantize_weight  # zcode.quant.linear imports this

    def case(fmt: str, num_rows: int, num_in: int, num_out: int, dtype: torch.dtype):
        def make(generator: torch.Generator):
            w = torch.randn(num_out, num_in, generator=generator) * num_in**-0.5
            x = torch.randn(num_rows, num_in, generator=generator).to(dtype)
            return quantize_weight(w, fmt), x

        name = f"{fmt}-M{num_rows}-K{num_in}-N{num_out}-{str(dtype).removeprefix('torch.')}"
        return name, make

    def gguf_case(ggml_type: int, num_rows: int, num_blocks: int, num_out: int, x16=False):
        def make(generator: torch.Generator):
            num_in = num_blocks * ACTIVATION_BLOCK.get(ggml_type, 32)
            x = torch.randn(num_rows, num_in, generator=generator)
            w = GgufWeight.random(ggml_type, num_out, num_in, generator)
            return (w.interleaved_copy() if x16 and interleaving_pays(ggml_type, num_out) else w), x

        layout = "-x16" if x16 else ""
        return f"gguf-{type_name(ggml_type)}{layout}-M{num_rows}-B{num_blocks}-N{num_out}", make

    return (
        [
            case(fmt, rows, k, n, dtype)
            for fmt in FORMATS
            for rows, k, n, dtype in (
                (1, 64, 48, torch.float32),
                (3, 101, 33, torch.float32),  # K and N odd: the padding paths
                (70, 576, 40, torch.bfloat16),  # past both packed kernels' row limits
            )
        ]
        + [
            gguf_case(ggml_type, rows, blocks, n)
            for ggml_type in sorted(GGUF_KERNEL_TYPES)
            for rows, blocks, n in (
                (1, 3, 33),  # N odd, K a few blocks
                (5, 1, 1),  # one block, one output
                (8, 2, 17),  # the GEMV's most rows
                (40, 2, 24),  # a prefill: the GEMM path
            )
        ]
        + [
            gguf_case(ggml_type, rows, blocks, n, x16=True)  # the interleaved layout, where it pays
            for ggml_type in sorted(INTERLEAVED_TYPES)
            for rows, blocks, n in ((1, 3, 32), (9, 2, 16), (40, 2, 48))
        ]
    )


# The autotuner times GGUF weights taller than this on their first rows: what it compares is the
# cost per row, and the reference dequantizes the weight whole (a 151552-row vocabulary matrix of
# 4096 columns would take 2.5 GB in fp32 and seconds per call, at a model's first token).
TUNING_MAX_ROWS = 4096


def tuning_args(packed: PackedWeight, x: torch.Tensor) -> tuple[PackedWeight, torch.Tensor]:
    if isinstance(packed, GgufWeight) and packed.out_features > TUNING_MAX_ROWS:
        packed = packed.rows(0, TUNING_MAX_ROWS)
    return packed, x


define_op("linear", reference, shape_class, cases, tolerance, tuning_args)


@register("linear", "format-fast")
def format_fast(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return packed.linear_fast(x)


def _weight_only_int(packed: PackedWeight, x: torch.Tensor) -> bool:
    return type(packed) in (Int8Weight, Int4Weight)


@register("linear", "packed", supports=_weight_only_int)
def packed_kernel(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return packed.mm_packed(x)


@register("linear", "dequantized", supports=_weight_only_int)
def dequantized_kernel(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return packed.mm_dequantized(x)


def _gemv_fits(packed: PackedWeight, x: torch.Tensor) -> bool:
    return (
        type(packed) in (Bf16Weight, W4A8Weight, W8A8Weight) and x.shape[0] <= packed.gemv_max_rows
    )


@register("linear", "gemv-cpp", supports=_gemv_fits)
def gemv_kernel(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    if not gemv_available():  # not gemv.available(): compiled graphs trace this function
        raise NotImplementedError("the C++ GEMV kernels do not build on this machine")
    return packed.mm_gemv(x)


@register("linear", "int4-kernels", supports=lambda packed, x: type(packed) is W4A8Weight)
def w4a8_on_int4_kernels(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return packed.mm_int4_kernels(x)


@register("linear", "int-mm", supports=lambda packed, x: type(packed) is W8A8Weight)
def w8a8_int_mm(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    return packed.mm_int_mm(x)


def _gguf_kernel_type(packed: PackedWeight, x: torch.Tensor) -> bool:
    return isinstance(packed, GgufWeight) and packed.ggml_type in GGUF_KERNEL_TYPES


@register(
    "linear",
    "ggml-gemv",
    supports=_gguf_kernel_type,
)
def ggml_gemv(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    if not ggml_available():  # compiled graphs trace this function
        raise NotImplementedError("the C++ GGUF kernels do not build on this machine")
    return packed.mm_gemv(x)


@register("linear", "ggml-dequantized", supports=_gguf_kernel_type)
def ggml_dequantized(packed: PackedWeight, x: torch.Tensor) -> torch.Tensor:
    if not ggml_available():
        raise NotImplementedError("the C++ GGUF kernels do not build on this machine")
    return packed.mm_dequantized(x)

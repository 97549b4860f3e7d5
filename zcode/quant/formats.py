"""The interface every weight format implements, the helpers they share, and the bf16 format.

A format holds one linear layer's weight W [N, K] in its own packed layout, as buffers (so
`state_dict` carries it), and computes `x @ W.T` two ways:

- `linear_reference(x)`: plain PyTorch that is obviously correct: dequantize, then F.linear in
  fp32; for the formats that also quantize activations (A8), the integer math in float64, where
  each product of an int8 code and a bf16-built weight is exact and the sums round far below
  fp32's precision.
- `linear_fast(x)`: the kernel bench/bench_linear.py measured fastest on this CPU, tested against
  the reference. Each format's docstring records the choice and the numbers behind it.

Scales and zero points are stored in bf16, the type the packed torch kernels take, so that the
reference and the fast path dequantize to the very same weights; rounding the scale *up* to a
bf16 value keeps the round-to-nearest error bound |w - dequantize(w)| <= scale / 2 exact.
"""

import platform
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

# Smallest scale: a group or channel that is all zeros still divides by something finite.
MIN_SCALE = 1e-8
GEMV_MAX_ROWS = 4  # rows the C++ decode GEMV takes (zcode/kernels/gemv.cpp's MAX_ROWS)
# Rows its bf16 and fp32 kernels take (MAX_FLOAT_ROWS): a step verifying drafts of 16 sequences
# multiplies up to 32 rows, where these kernels still ran SmolLM2's linears 1.2-1.5x (bf16) and
# 1.5-2x (fp32) faster than torch's F.linear (1.5-2x at 16 rows); capped at 16 rows, the
# verifying steps of a batch of 16 fell to F.linear, at ~2x a plain step's linears.
FLOAT_GEMV_MAX_ROWS = 32
ACT_QMAX = 127  # int8 activations are symmetric in [-127, 127]
# Weight rows dequantized per GEMM on the many-rows path: the bf16 tile (~0.6 MB at K = 576) stays
# in cache and no weight-sized buffer is allocated per call, which made SmolLM2's lm_head 2.4x
# faster to dequantize than in one piece.
DEQUANT_TILE_ROWS = 512


class PackedWeight(nn.Module, ABC):
    """One linear layer's weight [out_features, in_features] in a packed format."""

    gemv_max_rows = GEMV_MAX_ROWS  # rows up to which gemv_group runs (for its format's kernel)

    def __init__(self, out_features: int, in_features: int) -> None:
        super().__init__()
        self.out_features, self.in_features = out_features, in_features

    @classmethod
    @abstractmethod
    def quantize(cls, weight: torch.Tensor) -> "PackedWeight":
        """Round-to-nearest from a float weight [N, K]."""

    @abstractmethod
    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight this format stands for, [N, K]."""

    @abstractmethod
    def linear_fast(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float -> [M, N] (bf16 or fp32: the caller casts)."""

    def linear_reference(self, x: torch.Tensor) -> torch.Tensor:
        """x: [M, K] float -> [M, N] fp32."""
        return F.linear(x.float(), self.dequantize())

    @classmethod
    def gemv_group(cls, x: torch.Tensor, weights: Sequence["PackedWeight"]) -> torch.Tensor | None:
        """x [M, K] (1 <= M <= gemv_max_rows) times several weights of this format in one C++ GEMV
        call (zcode.kernels.gemv) -> [M, N_0 + N_1 + ...] fp32; None where the format has no such
        kernel or the weights cannot share a call. The caller checks gemv_available()."""
        return None

    @property
    @abstractmethod
    def weight_bytes(self) -> int:
        """Bytes the fast path reads per call: packed weight plus scales (the roofline's input)."""

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


class Bf16Weight(PackedWeight):
    """The weight rounded to bf16; the fast path is bf16 F.linear (oneDNN, AMX here; float_linear's
    fp32 GEMMs where the CPU has no bf16 arithmetic), and up to FLOAT_GEMV_MAX_ROWS rows the C++
    GEMV (zcode/kernels/gemv.cpp).

    At one row bf16 F.linear is ~10% slower than fp32 F.linear on this CPU despite half the
    bytes; from 8 rows up it is 2.5x faster, 3.2x at 64 and 5-6.6x at 512 (bench/bench_linear.py).
    The GEMV reads ~2x faster than bf16 F.linear at one row.
    """

    gemv_max_rows = FLOAT_GEMV_MAX_ROWS

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__(*weight.shape)
        self.register_buffer("weight", weight)  # bf16 [N, K]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Bf16Weight":
        return cls(weight.detach().to(torch.bfloat16).contiguous())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.weight.to(dtype)

    def linear_fast(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.gemv_max_rows and gemv_available():
            return self.mm_gemv(x)
        return float_linear(x.to(torch.bfloat16), self.weight)

    @classmethod
    def gemv_group(cls, x: torch.Tensor, weights: Sequence["Bf16Weight"]) -> torch.Tensor:
        return torch.ops.zcode.gemv_bf16(x, [w.weight for w in weights])

    def mm_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv_group(x, [self])

    @property
    def weight_bytes(self) -> int:
        return self.weight.numel() * 2


@torch.compiler.assume_constant_result  # compiled graphs take the answer, not the build
def gemv_available() -> bool:
    """Whether the C++ decode GEMV (zcode.kernels.gemv: torch.ops.zcode.gemv_*) builds here.
    Imported on first use: zcode.kernels imports this package."""
    from zcode.kernels import gemv

    return gemv.available()


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bf16_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest bf16 value >= each element of x (fp32): a scale that still covers the range."""
    rounded = x.to(torch.bfloat16)
    up = torch.nextafter(rounded, torch.tensor(float("inf"), dtype=torch.bfloat16))
    return torch.where(rounded.float() < x, up, rounded)


def pad_columns(x: torch.Tensor, num_columns: int) -> torch.Tensor:
    """x: [M, K] -> [M, num_columns], zero-filled on the right (no copy when already that wide)."""
    return x if x.shape[1] == num_columns else F.pad(x, (0, num_columns - x.shape[1]))


def linear_dequantized(
    x: torch.Tensor, num_rows: int, dequantize_rows: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """x [M, K] @ W.T with W dequantized DEQUANT_TILE_ROWS rows at a time by
    `dequantize_rows(start, end)` -> [end - start, K] in x's dtype. Returns [M, num_rows]."""
    tiles = [
        F.linear(x, dequantize_rows(start, min(start + DEQUANT_TILE_ROWS, num_rows)))
        for start in range(0, num_rows, DEQUANT_TILE_ROWS)
    ]
    return tiles[0] if len(tiles) == 1 else torch.cat(tiles, dim=1)


@torch.compiler.assume_constant_result  # compiled graphs take the answer, not /proc/cpuinfo
def bf16_arithmetic() -> bool:
    """Whether this CPU multiplies bf16 in hardware for torch's GEMMs: an x86 CPU with
    AVX512_BF16 or AMX-BF16 (oneDNN's bf16 kernels), or any other CPU (taken at its word).
    Without them oneDNN widens bf16 in its inner loops: SmolLM2's 576 -> 1536 linear at 512 rows
    ran 57 ms in bf16 against 8 ms in fp32 on a Zen 3 (AVX2)."""
    from zcode.hardware.probe import isa_flags

    flags = isa_flags()
    if flags is None or platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def float_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias), except bf16 on a CPU without bf16_arithmetic(): there the weight
    is widened to fp32 DEQUANT_TILE_ROWS rows at a time (exact) for fp32 GEMMs, and the output
    rounded to bf16 once, as a bf16 GEMM's fp32 sums are (SmolLM2's linears at 33-512 rows on
    Zen 3: 3.5-7x faster, no weight-sized buffer)."""
    if not (
        weight.dtype == x.dtype == torch.bfloat16
        and weight.device.type == "cpu"
        and not bf16_arithmetic()
    ):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    out = linear_dequantized(rows, weight.shape[0], lambda start, end: weight[start:end].float())
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16).view(*x.shape[:-1], weight.shape[0])


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 activations: x [M, K] -> (q int8 [M, K], scale fp32 [M, 1]).

    x ~= q * scale with |x - q * scale| <= scale / 2 (round to nearest, amax / 127 per row).
    """
    x = x.float()
    scale = (x.abs().amax(dim=1, keepdim=True) / ACT_QMAX).clamp_(min=MIN_SCALE)
    q = torch.round(x / scale).clamp_(-ACT_QMAX, ACT_QMAX).to(torch.int8)
    return q, scale

"""int8 weights per output channel, symmetric: weight-only (W8A16) or with int8 activations (W8A8).

w[n, k] = q[n, k] * scale[n], q in [-127, 127], scale = amax(|w[n]|) / 127 rounded up to bf16.
"""

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from zcode.quant.formats import (
    GEMV_MAX_ROWS,
    MIN_SCALE,
    PackedWeight,
    bf16_at_least,
    gemv_available,
    linear_dequantized,
    pad_columns,
    quantize_per_token,
    round_up,
)

QMAX = 127
# torch's _weight_int8pack_mm reads past the row (garbage or a crash) unless K % 16 == 0, so the
# packed weight carries zero columns up to that multiple.
K_MULTIPLE = 16
# Up to this many rows the packed int8 kernel beats dequantize-to-bf16 + bf16 F.linear.
PACKED_MAX_ROWS = 24


def channel_scales(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 -> bf16 [N]: amax / 127 per row, rounded up so every weight is in range."""
    return bf16_at_least((w.abs().amax(dim=1) / QMAX).clamp_(min=MIN_SCALE))


def codes_on_scale(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Round to nearest: w [N, k] fp32, scales bf16 [N] -> int8 [N, k]."""
    return torch.round(w / scales.float()[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)


class Int8Weight(PackedWeight):
    """W8A16: the weight in int8, activations stay float.

    Fast path, chosen by bench/bench_linear.py (1 thread, SmolLM2 shapes, shared machine): up to
    PACKED_MAX_ROWS rows torch.ops.aten._weight_int8pack_mm with bf16 activations, 2.3x fp32
    F.linear at one row (53 vs 121 us at K=576, N=1536; lm_head 2.1 vs 8.4 ms, ~14 GB/s). Its
    cost grows ~22 us per row, so past ~24 rows the weight is dequantized to bf16 tile by tile and
    multiplied with bf16 F.linear (AMX): 1.3x fp32 at 64 rows, 3.7x at 512. With fp32 activations
    the packed kernel takes a fallback 10x slower, hence the bf16 cast. torch.compile of the
    dequantize + linear is ~1.4x faster from 64 rows up but compiles per shape for seconds on two
    shared cores; not taken.
    """

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, in_features: int) -> None:
        super().__init__(qweight.shape[0], in_features)
        self.register_buffer("qweight", qweight)  # int8 [N, K rounded up to K_MULTIPLE]
        self.register_buffer("scales", scales)  # bf16 [N]

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> "Int8Weight":
        w = weight.detach().float()
        scales = channel_scales(w)
        return cls.from_codes(codes_on_scale(w, scales), scales)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor) -> "Int8Weight":
        """Packs precomputed codes (int8 [N, K] in [-127, 127]) with their bf16 scales [N]: how
        GPTQ's result lands in this very format."""
        if scales.shape != (codes.shape[0],):
            raise ValueError(f"need one scale per row of {tuple(codes.shape)}: {scales.shape}")
        codes = codes.to(torch.int8)
        return cls(pad_columns(codes, round_up(codes.shape[1], K_MULTIPLE)), scales, codes.shape[1])

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        q = self.qweight[:, : self.in_features]
        return q.to(dtype) * self.scales.to(dtype)[:, None]

    def linear_fast(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= PACKED_MAX_ROWS:
            return self.mm_packed(x)
        return self.mm_dequantized(x)

    def mm_packed(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_columns(x.to(torch.bfloat16), self.qweight.shape[1])
        return torch.ops.aten._weight_int8pack_mm(x, self.qweight, self.scales)

    def mm_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_columns(x.to(torch.bfloat16), self.qweight.shape[1])
        return linear_dequantized(x, self.out_features, self.dequantize_rows)

    def dequantize_rows(self, start: int, end: int) -> torch.Tensor:
        """Rows [start, end) of the padded weight in bf16."""
        return self.qweight[start:end].to(torch.bfloat16).mul_(self.scales[start:end, None])

    @property
    def weight_bytes(self) -> int:
        return self.qweight.numel() + self.scales.numel() * 2


class W8A8Weight(Int8Weight):
    """W8A8: the int8 weight times int8 activations quantized per token on the fly, int32 sums.

    out[m, n] = x_scale[m] * scale[n] * sum_k xq[m, k] * q[n, k]. Up to GEMV_MAX_ROWS rows the
    C++ VNNI GEMV (zcode/kernels/gemv.cpp), which needs each row's code sum; past that
    torch._int_mm (oneDNN, AMX-int8 here), exact in int32; only the fp32 rescaling differs from
    the float64 reference. _int_mm at one row trails the packed int8 kernel (85 vs 53 us at
    K=576, N=1536, 1.4x fp32); at 8 rows it is the fastest format (3.5-3.8x fp32), at 64 on par
    with bf16 (~3.2x), at 512 behind bf16 and int8 (2.6x vs 6.6x and 3.7x).
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        row_sums = self.qweight.sum(dim=1, dtype=torch.int32)  # [N]
        self.register_buffer("row_sums", row_sums, persistent=False)

    def linear_reference(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_per_token(x)
        acc = F.linear(xq.double(), self.qweight[:, : self.in_features].double())
        return (acc * x_scale.double() * self.scales.double()).float()

    def linear_fast(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS and gemv_available():
            return self.mm_gemv(x)
        return self.mm_int_mm(x)

    @classmethod
    def gemv_group(cls, x: torch.Tensor, weights: Sequence["W8A8Weight"]) -> torch.Tensor | None:
        if len({w.qweight.shape[1] for w in weights}) > 1:
            return None
        return torch.ops.zcode.gemv_w8a8(
            x,
            [w.qweight for w in weights],
            [w.scales for w in weights],
            [w.row_sums for w in weights],
            MIN_SCALE,
        )

    def mm_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv_group(x, [self])

    def mm_int_mm(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_per_token(x)
        acc = torch._int_mm(pad_columns(xq, self.qweight.shape[1]), self.qweight.t())  # [M, N]
        return acc.float() * x_scale * self.scales.float()

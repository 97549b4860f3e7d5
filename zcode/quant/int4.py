"""int4 weights in groups along K, asymmetric: weight-only (W4A16) and with int8 activations (W4A8).

Per group of `group_size` consecutive inputs of one output row: w = (q - 8) * scale + zero with
q in [0, 15] — torch's int4 kernel convention, so `zero` is the value of q = 8, not an integer
zero point. Asymmetric (scale and zero per group, both bf16, like llama.cpp's Q4_1) because it
spends all 16 levels on each group's [min, max]; the kernel reads a zero anyway.

Stored twice: `qweight`, two nibbles per byte in plain row-major order (low nibble = even k), is
the canonical layout — independent of the CPU, what `dequantize` and the many-row path read and
what a checkpoint would save; `packed` is the same nibbles in the blocked layout of
torch's CPU kernel, which depends on the ISA torch dispatches to. So the runtime footprint is 8
bits per weight; `weight_bytes` counts only what a decode step reads. A custom kernel reading
`qweight` directly would drop the second copy.
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

GROUP_SIZES = (32, 64, 128)  # the kernel also takes 256
N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu rejects N % 16 != 0: rows are zero-padded
# Up to this many rows the packed int4 kernel beats dequantize-to-bf16 + bf16 F.linear.
PACKED_MAX_ROWS = 64


def check_group_size(group_size: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size}")


def group_grid(groups: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The asymmetric grid of each group: groups [..., group] fp32 -> (scales, zeros) bf16 [...].

    The zero (the value of q = 8) sits 8/15 of the way from min to max; the scale, rounded up to
    bf16, reaches down to min and up to max from the rounded zero (q - 8 spans [-8, 7]).
    """
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    zeros = (lo + (hi - lo) * (8 / 15)).to(torch.bfloat16)
    z = zeros.float()
    scales = bf16_at_least(torch.maximum((hi - z) / 7, (z - lo) / 8).clamp_(min=MIN_SCALE))
    return scales, zeros


def codes_on_grid(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """Round to nearest on a grid: w [..., n] fp32, scales and zeros [...] -> uint8 [..., n]."""
    q = torch.round((w - zeros.float()[..., None]) / scales.float()[..., None]) + 8
    return q.clamp_(0, 15).to(torch.uint8)


class Int4Weight(PackedWeight):
    """W4A16: group-wise int4 weight, activations stay float.

    Fast path, chosen by bench/bench_linear.py (1 thread, SmolLM2 shapes, shared machine): up to
    PACKED_MAX_ROWS rows torch.ops.aten._weight_int4pack_mm_for_cpu with bf16 activations, 2.2x
    fp32 F.linear at one row (54 vs 121 us at K=576, N=1536; lm_head 1.5 vs 8.4 ms, ~11.6 GB/s,
    the single-thread bandwidth). Its cost grows ~22 us per row, so past ~64 rows the canonical
    nibbles are dequantized to bf16 tile by tile and multiplied with bf16 F.linear (AMX): 2.2x
    fp32 at 512 rows. The eager dequantize (~1.6 ns per weight) is what that path spends;
    torch.compile of dequantize + linear was slower (2.1 vs 1.6 ms at 64 rows).

    K is padded up to a multiple of the group size (SmolLM2's 576 is not a multiple of 128): the
    padding repeats the row's last value, so it never widens a group's range, and meets zero
    activations, so it adds nothing.
    """

    def __init__(
        self,
        qweight: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        group_size: int,
        out_features: int,
        in_features: int,
    ) -> None:
        super().__init__(out_features, in_features)
        self.group_size = group_size
        self.register_buffer("qweight", qweight)  # uint8 [N_pad, K_pad / 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros)  # bf16 [K_pad / group, N_pad, 2]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.unpack().int(), 1)
        self.register_buffer("packed", packed, persistent=False)

    @classmethod
    def quantize(cls, weight: torch.Tensor, group_size: int = 32) -> "Int4Weight":
        check_group_size(group_size)
        w = weight.detach().float()
        num_cols = w.shape[1]
        padded_cols = round_up(num_cols, group_size)
        w = torch.cat([w, w[:, -1:].expand(-1, padded_cols - num_cols)], dim=1)
        groups = w.view(w.shape[0], -1, group_size)  # [N, G, group]
        scales, zeros = group_grid(groups)
        codes = codes_on_grid(groups, scales, zeros).view(w.shape)
        return cls.from_codes(codes, scales, zeros, group_size, num_cols)

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor,
        group_size: int,
        in_features: int | None = None,
    ) -> "Int4Weight":
        """Packs precomputed codes (uint8 [N, K or K_pad] in [0, 15]) with their bf16 grid
        (scales and zeros [N, K_pad / group]): how GPTQ's result lands in this very format.

        Missing padding columns repeat the last column's code, as `quantize` pads (they meet
        zero activations, so any code would do); padding rows get a zero weight.
        """
        check_group_size(group_size)
        num_rows, num_cols = codes.shape
        in_features = num_cols if in_features is None else in_features
        padded_cols = round_up(in_features, group_size)
        if num_cols not in (in_features, padded_cols) or scales.shape != zeros.shape:
            raise ValueError(
                f"codes {tuple(codes.shape)}, scales {tuple(scales.shape)} and zeros "
                f"{tuple(zeros.shape)} do not fit in_features {in_features}, group {group_size}"
            )
        if scales.shape != (num_rows, padded_cols // group_size):
            raise ValueError(f"need one scale per group: {tuple(scales.shape)}")
        padded_rows = round_up(num_rows, N_MULTIPLE) - num_rows
        q = codes.to(torch.uint8)
        q = torch.cat([q, q[:, -1:].expand(-1, padded_cols - num_cols)], dim=1)
        q = F.pad(q, (0, 0, 0, padded_rows), value=8)
        pad_scale = bf16_at_least(torch.full((padded_rows, scales.shape[1]), MIN_SCALE))
        scales = torch.cat([scales.to(torch.bfloat16), pad_scale])
        zeros = F.pad(zeros.to(torch.bfloat16), (0, 0, 0, padded_rows))
        qweight = q[:, 0::2] | (q[:, 1::2] << 4)
        scales_and_zeros = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        return cls(qweight, scales_and_zeros, group_size, num_rows, in_features)

    def unpack(self) -> torch.Tensor:
        """The integer codes, uint8 [N_pad, K_pad] in [0, 15]."""
        q = torch.stack([self.qweight & 15, self.qweight >> 4], dim=-1)
        return q.view(self.qweight.shape[0], -1)

    def dequantize_rows(
        self, start: int, end: int, dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """Rows [start, end) of the padded weight, [end - start, K_pad]."""
        # In place in one buffer: this runs per call on the many-rows path.
        qweight = self.qweight[start:end]
        out = torch.empty(*qweight.shape, 2, dtype=dtype)
        out[..., 0] = qweight & 15
        out[..., 1] = qweight >> 4
        groups = out.view(end - start, -1, self.group_size)  # [rows, G, group]
        scales_and_zeros = self.scales_and_zeros[:, start:end].to(dtype).transpose(0, 1)
        scales, zeros = scales_and_zeros.unbind(-1)  # [rows, G]
        groups.sub_(8).mul_(scales[..., None]).add_(zeros[..., None])
        return out.view(end - start, -1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.dequantize_rows(0, self.out_features, dtype)[:, : self.in_features]

    def linear_fast(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= PACKED_MAX_ROWS:
            return self.mm_packed(x)
        return self.mm_dequantized(x)

    def mm_packed(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_columns(x.to(torch.bfloat16), self.qweight.shape[1] * 2)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, self.group_size, self.scales_and_zeros
        )
        return out[:, : self.out_features]

    def mm_dequantized(self, x: torch.Tensor) -> torch.Tensor:
        x = pad_columns(x.to(torch.bfloat16), self.qweight.shape[1] * 2)
        return linear_dequantized(x, self.out_features, self.dequantize_rows)

    @property
    def weight_bytes(self) -> int:
        return self.packed.numel() + self.scales_and_zeros.numel() * 2


class W4A8Weight(Int4Weight):
    """W4A8: the group-wise int4 weight times int8 activations quantized per token on the fly.

    out[m, n] = x_scale[m] * sum_k xq[m, k] * w[n, k]. Up to gemv.MAX_ROWS rows the C++ kernel
    (zcode/kernels/gemv.cpp) does exactly this with VNNI integer dot products, reading the nibbles
    and a row-major copy of the scales; there it is ~1.5x torch's W4A16 int4 kernel. Past that, or
    where the kernel does not build, the int8 codes, exact in bf16, go through the W4A16 kernels
    and x_scale is applied afterwards: the same math, summed in fp32, rounded to bf16 once.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # bf16 [N_pad, K_pad / group, 2]: the GEMV reads one weight row's (scale, zero) pairs.
        row_scales = self.scales_and_zeros.transpose(0, 1).contiguous()
        self.register_buffer("row_scales_and_zeros", row_scales, persistent=False)

    def linear_reference(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_per_token(x)
        acc = F.linear(xq.double(), self.dequantize(torch.float64))
        return (acc * x_scale.double()).float()

    def linear_fast(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= GEMV_MAX_ROWS and gemv_available():
            return self.mm_gemv(x)
        return self.mm_int4_kernels(x)

    @classmethod
    def gemv_group(cls, x: torch.Tensor, weights: Sequence["W4A8Weight"]) -> torch.Tensor | None:
        group_size, padded_cols = weights[0].group_size, weights[0].qweight.shape[1]
        if any(w.group_size != group_size or w.qweight.shape[1] != padded_cols for w in weights):
            return None
        return torch.ops.zcode.gemv_w4a8(
            x,
            [w.qweight for w in weights],
            [w.row_scales_and_zeros for w in weights],
            group_size,
            [w.out_features for w in weights],
            MIN_SCALE,
        )

    def mm_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self.gemv_group(x, [self])

    def mm_int4_kernels(self, x: torch.Tensor) -> torch.Tensor:
        xq, x_scale = quantize_per_token(x)
        return super().linear_fast(xq.to(torch.bfloat16)).float() * x_scale

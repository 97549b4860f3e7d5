"""QuantizedLinear: an nn.Linear whose weight is held in one packed format, and the format names."""

from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from torch import nn

from zcode.quant.formats import Bf16Weight, PackedWeight
from zcode.quant.int4 import Int4Weight, W4A8Weight
from zcode.quant.int8 import Int8Weight, W8A8Weight

Kernel = Literal["reference", "fast"]
KERNELS = ("reference", "fast")

# Format name -> round-to-nearest quantizer. "w4a8" groups by 32, like "int4-g32".
FORMATS: dict[str, Callable[[torch.Tensor], PackedWeight]] = {
    "bf16": Bf16Weight.quantize,
    "int8": Int8Weight.quantize,
    "w8a8": W8A8Weight.quantize,
    **{f"int4-g{g}": partial(Int4Weight.quantize, group_size=g) for g in (32, 64, 128)},
    "w4a8": partial(W4A8Weight.quantize, group_size=32),
    **{f"w4a8-g{g}": partial(W4A8Weight.quantize, group_size=g) for g in (64, 128)},
}


def quantize_weight(weight: torch.Tensor, fmt: str) -> PackedWeight:
    """A float weight [N, K] in the named format, by round-to-nearest."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMATS)}")
    return FORMATS[fmt](weight)


class QuantizedLinear(nn.Module):
    """y = x @ W.T + b with W in a packed format; `kernel` picks the reference or the fast path.

    The fast path is the kernel registry's autotuned choice for op `linear` (zcode.kernels), per
    row count bucket and dtype, remembered per module so a step pays one dict lookup per call.
    Input and output keep the caller's dtype (fp32 or bf16); the bias stays as it was.
    """

    def __init__(
        self, packed: PackedWeight, bias: nn.Parameter | None, fmt: str, kernel: Kernel = "fast"
    ) -> None:
        super().__init__()
        self.packed = packed
        self.register_parameter("bias", bias)
        self.format = fmt
        self.kernel = kernel
        self._fast: dict[tuple[int, torch.dtype], Callable] = {}  # (rows, dtype) -> kernel

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str, kernel: Kernel = "fast") -> "QuantizedLinear":
        return cls(quantize_weight(linear.weight, fmt), linear.bias, fmt, kernel)

    @property
    def kernel(self) -> Kernel:
        return self._kernel

    @kernel.setter
    def kernel(self, kernel: Kernel) -> None:
        if kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
        self._kernel = kernel

    @property
    def in_features(self) -> int:
        return self.packed.in_features

    @property
    def out_features(self) -> int:
        return self.packed.out_features

    @property
    def weight_bytes(self) -> int:
        """Bytes of weight (with scales, without bias) the fast path reads per call."""
        return self.packed.weight_bytes

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.weight_bytes / (self.in_features * self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:
            out = rows.new_zeros(0, self.out_features)
        elif self.kernel == "fast":
            out = self.fast_kernel(rows)(self.packed, rows)
        else:
            out = self.packed.linear_reference(rows)
        out = out.to(x.dtype)
        if self.bias is not None:
            out = out + self.bias.to(x.dtype)
        return out.view(*x.shape[:-1], self.out_features)

    def fast_kernel(self, rows: torch.Tensor) -> Callable:
        key = (rows.shape[0], rows.dtype)
        if (fn := self._fast.get(key)) is None:
            if torch.compiler.is_compiling():
                # Autotuning takes a lock and times kernels, neither of which dynamo can trace:
                # a compiled graph runs the format's own fast path unless an eager call chose.
                return type(self.packed).linear_fast
            from zcode.kernels import get  # zcode.kernels' linear op imports this module

            fn = self._fast[key] = get("linear", self.packed, rows)
        return fn

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"format={self.format}, kernel={self.kernel}, bias={self.bias is not None}"
        )

"""Op `rmsnorm_residual`: h = x + residual; returns (RMSNorm(h), h), the pre-norm block's pair.

Reference: zcode.layers.norm.RMSNorm on the sum. CPU variant: the sum in place into a new
buffer and one fused F.rms_norm in fp32 (the layer fuses only when everything is fp32).
"""

import torch
import torch.nn.functional as F

from zcode.kernels.registry import define_op, register
from zcode.layers.norm import RMSNorm


def reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    # x, residual: [T, D]; weight: [D] -> ([T, D], [T, D])
    norm = RMSNorm(weight.shape[0], eps).to(weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    summed = x + residual
    return norm(summed), summed


def shape_class(x: torch.Tensor, residual, weight, eps) -> str:
    rows = "1" if x.shape[0] == 1 else "<=64" if x.shape[0] <= 64 else "many"
    return f"D{x.shape[-1]}|rows{rows}|{str(x.dtype).removeprefix('torch.')}"


def tolerance(x: torch.Tensor, *args) -> tuple[float, float]:
    return (1e-5, 1e-5) if x.dtype == torch.float32 else (1.6e-2, 1.6e-2)


def cases() -> list:
    def case(rows: int, dim: int, dtype: torch.dtype):
        def make(generator: torch.Generator):
            x, residual = (torch.randn(rows, dim, generator=generator).to(dtype) for _ in "xr")
            weight = (1 + 0.1 * torch.randn(dim, generator=generator)).to(dtype)
            return x, residual, weight, 1e-6

        return f"T{rows}-D{dim}-{str(dtype).removeprefix('torch.')}", make

    return [case(1, 64, torch.float32), case(7, 97, torch.float32), case(5, 576, torch.bfloat16)]


define_op("rmsnorm_residual", reference, shape_class, cases, tolerance)


@register("rmsnorm_residual", "fused-fp32")
def fused_fp32(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = torch.add(x, residual)
    normed = F.rms_norm(summed.float(), weight.shape, weight.float(), eps)
    return normed.to(x.dtype), summed

"""Op `rotary`: RoPE on the first 2 * cos.shape[-1] features of each head (half-split or
interleaved pairs, see zcode.layers.rotary.apply_rotary, the reference).

CPU variant: writes both rotated halves and the pass-through into one preallocated output
instead of building it from three concatenations.
"""

import torch

from zcode.kernels.registry import define_op, register
from zcode.layers.rotary import apply_rotary


def reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    # x: [T, H, D]; cos, sin: [T, R/2] -> [T, H, D]
    return apply_rotary(x, cos, sin, interleaved)


def shape_class(x: torch.Tensor, cos: torch.Tensor, sin, interleaved: bool) -> str:
    rows = "1" if x.shape[0] == 1 else "many"
    layout = "interleaved" if interleaved else "half"
    return f"H{x.shape[1]}xD{x.shape[2]}xR{2 * cos.shape[-1]}|{layout}|rows{rows}|{x.dtype}"


def tolerance(x: torch.Tensor, *args) -> tuple[float, float]:
    return (1e-6, 1e-6) if x.dtype == torch.float32 else (1e-2, 1e-2)


def cases() -> list:
    def case(rows: int, heads: int, dim: int, rotary_dim: int, interleaved: bool, dtype):
        def make(generator: torch.Generator):
            x = torch.randn(rows, heads, dim, generator=generator).to(dtype)
            angles = torch.rand(rows, rotary_dim // 2, generator=generator) * 6.3
            return x, angles.cos(), angles.sin(), interleaved

        layout = "interleaved" if interleaved else "half"
        return f"T{rows}-H{heads}-D{dim}-R{rotary_dim}-{layout}-{dtype}", make

    return [
        case(1, 12, 64, 64, False, torch.float32),
        case(5, 3, 64, 32, False, torch.float32),  # partial rotary: a pass-through tail
        case(6, 2, 24, 8, True, torch.float32),
        case(3, 4, 64, 64, True, torch.bfloat16),
    ]


define_op("rotary", reference, shape_class, cases, tolerance)


@register("rotary", "preallocated")
def preallocated(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    half = cos.shape[-1]
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
    else:
        x1, x2 = x[..., :half], x[..., half : 2 * half]
    out = torch.empty_like(x)
    torch.mul(x1, cos, out=out[..., :half]).sub_(x2 * sin)
    torch.mul(x2, cos, out=out[..., half : 2 * half]).add_(x1 * sin)
    out[..., 2 * half :] = x[..., 2 * half :]
    return out

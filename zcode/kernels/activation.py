"""Op `silu_gate`: silu(gate) * up, the SwiGLU activation between up- and down-projection.

Reference: zcode.layers.mlp.GatedMLP's expression. CPU variant: in place on silu's output,
one buffer instead of two.
"""

import torch
import torch.nn.functional as F

from zcode.kernels.registry import define_op, register


def reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    # gate, up: [T, I] -> [T, I]
    return F.silu(gate) * up


def shape_class(gate: torch.Tensor, up: torch.Tensor) -> str:
    size = "small" if gate.numel() <= 1 << 14 else "large"
    return f"{size}|{str(gate.dtype).removeprefix('torch.')}"


def tolerance(gate: torch.Tensor, up: torch.Tensor) -> tuple[float, float]:
    return (1e-6, 1e-6) if gate.dtype == torch.float32 else (1e-2, 1e-2)


def cases() -> list:
    def case(rows: int, dim: int, dtype: torch.dtype):
        def make(generator: torch.Generator):
            return tuple(torch.randn(rows, dim, generator=generator).to(dtype) for _ in "gu")

        return f"T{rows}-I{dim}-{str(dtype).removeprefix('torch.')}", make

    return [case(1, 1536, torch.float32), case(9, 131, torch.float32), case(4, 96, torch.bfloat16)]


define_op("silu_gate", reference, shape_class, cases, tolerance)


@register("silu_gate", "inplace")
def inplace(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate).mul_(up)

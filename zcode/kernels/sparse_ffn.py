"""Op `sparse_ffn`: the SwiGLU FFN restricted to selected neurons, the dense model's
down(silu(gate x) * up x) with only rows `neuron_ids` of gate/up and of down's transpose
(`w_down_t` [I, D], as SparseMLP stores it: a neuron's down weights are one contiguous row).

Reference: GatedMLP's expression on the index-selected weight slices. CPU variant: `fused-rows`
stacks the selected gate and up rows into one weight so the two projections are one GEMM.
"""

import torch
import torch.nn.functional as F

from zcode.kernels.registry import define_op, register


def reference(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down_t: torch.Tensor,
    neuron_ids: torch.Tensor,
) -> torch.Tensor:
    """x: [T, D]; w_gate, w_up, w_down_t: [I, D]; neuron_ids: [n] -> [T, D]."""
    gate, up, down_t = w_gate[neuron_ids], w_up[neuron_ids], w_down_t[neuron_ids]  # [n, D]
    return (F.silu(F.linear(x, gate)) * F.linear(x, up)) @ down_t


def shape_class(x, w_gate, w_up, w_down_t, neuron_ids) -> str:
    rows = "1" if x.shape[0] == 1 else "<=64" if x.shape[0] <= 64 else "many"
    density = neuron_ids.numel() / w_gate.shape[0]
    return f"I{w_gate.shape[0]}xD{x.shape[1]}|density<={_bucket(density)}|rows{rows}|{x.dtype}"


def _bucket(density: float) -> float:
    return next(b for b in (0.125, 0.25, 0.5, 1.0) if density <= b)


def cases() -> list:
    def case(rows: int, hidden: int, inter: int, num_kept: int):
        def make(generator: torch.Generator):
            x = torch.randn(rows, hidden, generator=generator)
            w_gate, w_up = (
                torch.randn(inter, hidden, generator=generator) * hidden**-0.5 for _ in "gu"
            )
            w_down_t = (torch.randn(hidden, inter, generator=generator) * inter**-0.5).t()
            ids = torch.randperm(inter, generator=generator)[:num_kept].sort().values
            return x, w_gate, w_up, w_down_t.contiguous(), ids

        return f"T{rows}-D{hidden}-I{inter}-n{num_kept}", make

    return [case(1, 64, 256, 32), case(5, 72, 300, 77), case(2, 33, 17, 17), case(20, 40, 90, 50)]


define_op("sparse_ffn", reference, shape_class, cases)


@register("sparse_ffn", "fused-rows")
def fused_rows(x, w_gate, w_up, w_down_t, neuron_ids) -> torch.Tensor:
    num_kept = neuron_ids.numel()
    gate_up = torch.cat([w_gate[neuron_ids], w_up[neuron_ids]])  # [2n, D]
    gate, up = F.linear(x, gate_up).split([num_kept, num_kept], dim=-1)
    return F.silu(gate).mul_(up) @ w_down_t[neuron_ids]

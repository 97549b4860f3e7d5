"""Linear: nn.Linear whose bf16 and fp32 decode calls run the C++ GEMV (zcode.kernels.gemv), and
linear_group: sibling linears that share their input (q/k/v, gate/up) as one GEMV call.

At one row a linear only reads its weight. The GEMV reads bf16 ~2x faster than torch's bf16
F.linear on AVX-512 BF16 CPUs, and fp32 2-3% faster than MKL's sgemv (its prefetch); up to
FLOAT_GEMV_MAX_ROWS rows (a verifying step's), 4 at a time, it stays 1.2-2x faster than F.linear;
every other call (prefill, other dtypes, no kernel on this machine, autograd) is F.linear (bf16
through fp32 GEMMs where the CPU has no bf16 arithmetic: zcode.quant.formats.float_linear). Same
parameters and names as nn.Linear.
"""

from collections.abc import Sequence

import torch
from torch import nn

from zcode.quant.formats import FLOAT_GEMV_MAX_ROWS, float_linear, gemv_available
from zcode.quant.linear import QuantizedLinear


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        if _takes_gemv(self, x):
            out = _GEMV[self.weight.dtype](x.reshape(-1, self.in_features), [self.weight])
            return _finish(out, self, x)
        return float_linear(x, self.weight, self.bias)


def linear_group(x: torch.Tensor, linears: Sequence[nn.Module]) -> list[torch.Tensor]:
    """x through sibling linear modules that all read it: [..., K] -> [[..., N_i] per module].

    At decode (up to FLOAT_GEMV_MAX_ROWS rows for zcode Linear, the format's `gemv_max_rows`
    for QuantizedLinear) siblings of one GEMV format, all zcode Linear with bf16 or fp32 weights,
    or all QuantizedLinear in one of W4A8, W8A8, bf16 or GGUF on their fast kernel, run as one
    GEMV call: one dispatch, one activation quantization and
    one parallel region instead of one per module (SmolLM2's W4A8 GEMVs in model order: 4.1 ->
    3.4 ms a step, 211 -> 121 calls). A group takes the GEMV even where a QuantizedLinear alone
    would take another autotuned kernel: those choices were timed one small matrix at a time,
    with the per-call costs a group saves. Anything else, and modules with hooks (calibration
    hooks expect their own calls), runs module by module, as `[m(x) for m in linears]`.
    """
    if (out := _gemv_group(x, linears)) is None:
        return [linear(x) for linear in linears]
    parts = out.split([linear.out_features for linear in linears], dim=-1)
    return [_finish(part, linear, x) for part, linear in zip(parts, linears)]


def _gemv_group(x: torch.Tensor, linears: Sequence[nn.Module]) -> torch.Tensor | None:
    """[M, sum N] fp32 from one GEMV call, or None where the group cannot take one."""
    if any(m._forward_hooks or m._forward_pre_hooks for m in linears):
        return None
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    if all(type(m) is Linear and _takes_gemv(m, x) for m in linears):  # all of x's dtype
        return _GEMV[x.dtype](rows, [m.weight for m in linears])
    if not all(isinstance(m, QuantizedLinear) and m.kernel == "fast" for m in linears):
        return None
    packed = [m.packed for m in linears]
    if (
        len({type(p) for p in packed}) == 1
        and 0 < rows.shape[0] <= packed[0].gemv_max_rows
        and gemv_available()
    ):
        return type(packed[0]).gemv_group(rows, packed)
    return None


def gemv_row_limit(model: nn.Module) -> int | None:
    """Rows up to which the model's bf16 and fp32 linears run the C++ GEMV, F.linear above
    (None where none runs it). Each of the two gives a row the same bits at any row count, but
    not the bits of the other: a verifying step whose rows cross the limit while the plain step
    of the same sequences does not would move greedy tokens off near-ties (the engine cuts its
    drafts instead)."""
    float_gemv = any(
        type(m) is Linear and m.weight.dtype in _GEMV and m.weight.device.type == "cpu"
        for m in model.modules()
    )
    return FLOAT_GEMV_MAX_ROWS if float_gemv and gemv_available() else None


def _takes_gemv(linear: nn.Linear, x: torch.Tensor) -> bool:
    w = linear.weight
    return (
        w.dtype in _GEMV
        and x.dtype == w.dtype
        and 0 < x.numel() <= FLOAT_GEMV_MAX_ROWS * linear.in_features
        and w.device.type == "cpu"
        and w.is_contiguous()
        and not (w.requires_grad and torch.is_grad_enabled())  # the kernel has no backward
        and gemv_available()
    )


def _finish(out: torch.Tensor, linear: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A GEMV's fp32 [M, N] as the module's output: x's dtype and leading shape, plus bias."""
    out = out.to(x.dtype)
    if linear.bias is not None:
        out = out + linear.bias.to(x.dtype)
    return out.view(*x.shape[:-1], linear.out_features)


# Looked up per call: torch.ops.zcode exists only once gemv_available() has built the kernels.
_GEMV = {
    torch.bfloat16: lambda x, ws: torch.ops.zcode.gemv_bf16(x, ws),
    torch.float32: lambda x, ws: torch.ops.zcode.gemv_f32(x, ws),
}

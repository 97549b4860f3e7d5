"""GPTQ (Frantar et al., 2022): quantize a weight column by column and push each column's rounding
error onto the columns not yet quantized, weighted by the inverse Hessian of the layer's inputs.

For a linear y = x W^T with calibration inputs X [T, K], the layer's squared output error
||X W^T - X Q^T||^2 is a quadratic form in the weight error with Hessian H = X^T X. Quantizing
column j and updating the remaining columns by -err_j * Hinv[j, j+1:] / Hinv[j, j] minimizes that
form given the columns already fixed (the Optimal Brain Surgeon step); the upper Cholesky factor
of H^-1 holds exactly these rows, so one factorization serves all columns. Columns go in lazy
blocks of BLOCK_COLUMNS: the updates inside a block are applied at once to the rest at its end.

The grids are the formats' own (int4.group_grid, int8.channel_scales), so the result is packed by
Int4Weight.from_codes / Int8Weight.from_codes into the very buffers the tested kernels read. A
group's scale and zero are computed when the loop reaches the group's first column, from the
weights as updated by then. With H = identity no error moves and GPTQ is round-to-nearest.
"""

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from zcode.quant.formats import Bf16Weight, PackedWeight
from zcode.quant.int4 import Int4Weight, W4A8Weight, codes_on_grid, group_grid
from zcode.quant.int8 import Int8Weight, W8A8Weight, channel_scales, codes_on_scale

BLOCK_COLUMNS = 128  # a multiple of every int4 group size, so a group never straddles two blocks
DAMP_RATIO = 0.01  # of the mean Hessian diagonal, added to the diagonal (the paper's 1%)

# Format name -> (packed class, int4 group size or None).
FORMAT_LAYOUTS: dict[str, tuple[type[PackedWeight], int | None]] = {
    "bf16": (Bf16Weight, None),
    "int8": (Int8Weight, None),
    "w8a8": (W8A8Weight, None),
    **{f"int4-g{g}": (Int4Weight, g) for g in (32, 64, 128)},
    "w4a8": (W4A8Weight, 32),
    **{f"w4a8-g{g}": (W4A8Weight, g) for g in (64, 128)},
}


@contextmanager
def one_thread() -> Iterator[None]:
    """The column loop is thousands of tiny ops: on two shared cores, two threads spent 20-40x
    longer in barriers than one thread computing (15.6 vs 0.21 s for a 576 x 576 weight)."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


def format_layout(fmt: str) -> tuple[type[PackedWeight], int | None]:
    if fmt not in FORMAT_LAYOUTS:
        raise ValueError(f"unknown weight format {fmt!r}; known: {', '.join(FORMAT_LAYOUTS)}")
    return FORMAT_LAYOUTS[fmt]


def inverse_hessian_factor(hessian: torch.Tensor, damp_ratio: float = DAMP_RATIO) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * I)^-1, fp32 [K, K]; H [K, K] must have no zero
    diagonal (the caller drops dead inputs first)."""
    h = hessian.double().clone()
    h.diagonal().add_(damp_ratio * h.diagonal().mean())
    try:
        lower = torch.linalg.cholesky(h)
        return torch.linalg.cholesky(torch.cholesky_inverse(lower), upper=True).float()
    except torch.linalg.LinAlgError as e:
        raise ValueError(f"Hessian is not positive definite after {damp_ratio:.0%} damping") from e


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    fmt: str,
    damp_ratio: float = DAMP_RATIO,
) -> PackedWeight:
    """weight [N, K], hessian X^T X [K, K] of its inputs -> the weight in format `fmt`."""
    cls, group_size = format_layout(fmt)
    w = weight.detach().float().clone()  # [N, K], updated in place as errors are pushed right
    num_rows, num_cols = w.shape
    if hessian.shape != (num_cols, num_cols):
        raise ValueError(f"Hessian {tuple(hessian.shape)} does not fit weight {tuple(w.shape)}")
    hessian = hessian.double().clone()
    # An input that is always zero: its weights never matter; give it a unit curvature.
    dead = hessian.diagonal() == 0
    hessian[dead, dead] = 1
    w[:, dead] = 0
    hinv = inverse_hessian_factor(hessian, damp_ratio)

    with one_thread():
        return _gptq_loop(w, hinv, cls, group_size)


def _gptq_loop(
    w: torch.Tensor, hinv: torch.Tensor, cls: type[PackedWeight], group_size: int | None
) -> PackedWeight:
    num_rows, num_cols = w.shape
    dequantized = torch.empty_like(w)
    if cls is Bf16Weight:
        codes = None
    elif group_size is None:
        codes = torch.empty(num_rows, num_cols, dtype=torch.int8)
        scales = channel_scales(w)
    else:
        codes = torch.empty(num_rows, num_cols, dtype=torch.uint8)
        num_groups = -(-num_cols // group_size)
        scales = torch.empty(num_rows, num_groups, dtype=torch.bfloat16)
        zeros = torch.empty(num_rows, num_groups, dtype=torch.bfloat16)

    for start in range(0, num_cols, BLOCK_COLUMNS):
        end = min(start + BLOCK_COLUMNS, num_cols)
        block = w[:, start:end].clone()  # [N, B]
        errors = torch.empty_like(block)
        hinv_block = hinv[start:end, start:end]
        for i in range(end - start):
            col = start + i
            column = block[:, i]
            if cls is Bf16Weight:
                q = column.to(torch.bfloat16).float()
            elif group_size is None:
                code = codes_on_scale(column[:, None], scales)[:, 0]
                codes[:, col] = code
                q = code.float() * scales.float()
            else:
                group = col // group_size
                if col % group_size == 0:
                    scales[:, group], zeros[:, group] = group_grid(block[:, i : i + group_size])
                s, z = scales[:, group], zeros[:, group]
                code = codes_on_grid(column[:, None], s, z)[:, 0]
                codes[:, col] = code
                q = (code.float() - 8) * s.float() + z.float()
            dequantized[:, col] = q
            error = (column - q) / hinv_block[i, i]
            block[:, i:] -= error[:, None] * hinv_block[i, i:][None, :]
            errors[:, i] = error
        w[:, end:] -= errors @ hinv[start:end, end:]

    if cls is Bf16Weight:
        return Bf16Weight(dequantized.to(torch.bfloat16))
    if group_size is None:
        return cls.from_codes(codes, scales)
    return cls.from_codes(codes, scales, zeros, group_size, num_cols)

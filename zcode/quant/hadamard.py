"""Hadamard rotation of a linear layer's input space, to spread activation and weight outliers.

y = x W^T = (x R)(W R)^T for any orthogonal R. With R = D B — D a random +-1 diagonal, B a
block-diagonal of normalized Hadamard matrices — x R and W R mix each block of inputs evenly, so
one large channel no longer sets a whole int8 row's or int4 group's scale (QuaRot, SpinQuant).
SmolLM2's widths (576, 1536) are not powers of two, so the block is the largest power of two up
to MAX_BLOCK that divides K: 64 for both. `rotate` applies R to the last dimension of anything,
so the same function turns the weight's rows into W R and the activations into x R online.
"""

import torch
from scipy.linalg import hadamard
from torch import nn

MAX_BLOCK = 64


def hadamard_block(in_features: int, max_block: int = MAX_BLOCK) -> int:
    """The largest power of two <= max_block that divides in_features."""
    block = 1
    while block * 2 <= max_block and in_features % (block * 2) == 0:
        block *= 2
    return block


def random_signs(in_features: int, seed: int) -> torch.Tensor:
    """+-1 fp32 [K], reproducible from the seed."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (in_features,), generator=generator).float() * 2 - 1


def hadamard_matrix(block: int) -> torch.Tensor:
    """The orthonormal Hadamard matrix, fp32 [block, block] (symmetric)."""
    return torch.from_numpy(hadamard(block)).float() / block**0.5


def rotate(x: torch.Tensor, signs: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> x R, [..., K], with R = diag(signs) blockdiag(matrix); in fp32, or fp64 for
    fp64 input."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    block = matrix.shape[0]
    y = (x.to(dtype) * signs.to(dtype)).unflatten(-1, (-1, block))  # [..., K / block, block]
    return (y @ matrix.to(dtype)).flatten(-2)


def rotate_hessian(hessian: torch.Tensor, signs: torch.Tensor, matrix: torch.Tensor):
    """X^T X [K, K] -> (X R)^T (X R) = R^T X^T X R."""
    return rotate(rotate(hessian, signs, matrix).T, signs, matrix)


class RotatedLinear(nn.Module):
    """y = linear(x R), where `linear` holds W R (in any format): the same map as W.

    `signs` is a persistent buffer, so an artifact carries the rotation; the Hadamard block is
    rebuilt from K. Input and output keep the caller's dtype; the rotation runs in fp32.
    """

    def __init__(self, linear: nn.Module, signs: torch.Tensor) -> None:
        super().__init__()
        self.linear = linear
        self.register_buffer("signs", signs.float())  # [K]
        matrix = hadamard_matrix(hadamard_block(signs.shape[0]))
        self.register_buffer("matrix", matrix, persistent=False)  # [block, block]

    @property
    def format(self) -> str:
        return getattr(self.linear, "format", "fp32")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.signs, self.matrix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K] -> [..., N]
        return self.linear(self.rotate(x)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"hadamard_block={self.matrix.shape[0]}"

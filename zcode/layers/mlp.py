import torch
import torch.nn.functional as F
from torch import nn

from zcode.layers.linear import Linear, linear_group


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)), HF parameter names."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_group(x, (self.gate_proj, self.up_proj))
        return self.down_proj(self.activation(gate) * up)


class GeluGatedMLP(GatedMLP):
    """GeGLU feed-forward (Gemma's hidden_activation gelu_pytorch_tanh): the gate through
    tanh-approximated GELU. A subclass, so the FFN sparsity swap (`type(mlp) is GatedMLP`, whose
    kernels assume silu) leaves it alone."""

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate="tanh")

"""Adaptive expert count for DeepSeek-style MoE layers (glm4_moe, glm_moe_dsa): a token keeps
only as many of its top_k routed experts as it takes to reach `mass` of its routing weight, so a
confident router runs fewer experts. The kept weights are rescaled to the full top_k total, so
the layer's output scale is unchanged. mass = 1.0 keeps all top_k: exactly the dense MoE.
"""

import torch
from torch import nn

from zcode.layers.moe import MoE


class AdaptiveMoE(nn.Module):
    """Runs the wrapped MoE's router, experts and shared expert (shared, not copied)."""

    def __init__(self, moe: MoE, mass: float, min_experts: int = 1) -> None:
        super().__init__()
        if not 0.0 < mass <= 1.0:
            raise ValueError(f"mass must be in (0, 1], got {mass}")
        self.moe, self.mass, self.min_experts = moe, mass, min_experts
        self.experts_run, self.tokens_seen = 0, 0  # counters for the bench

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D]
        moe = self.moe
        weights, expert_ids = moe.gate(x)  # [T, top_k]
        if self.mass < 1.0:
            weights = keep_mass(weights, self.mass, self.min_experts)
        out = torch.zeros_like(x)
        kept = weights > 0
        self.experts_run += int(kept.sum())
        self.tokens_seen += x.shape[0]
        for expert_id in expert_ids[kept].unique().tolist():
            token_ids, slot = torch.where((expert_ids == expert_id) & kept)
            expert_out = moe.experts[expert_id](x[token_ids])
            out.index_add_(0, token_ids, expert_out * weights[token_ids, slot, None].to(x.dtype))
        return out + moe.shared_experts(x)


def keep_mass(weights: torch.Tensor, mass: float, min_experts: int) -> torch.Tensor:
    """Zeroes each row's smallest weights past `mass` of its total; rescales the rest to it."""
    # weights: [T, K] >= 0 -> [T, K]
    total = weights.sum(-1, keepdim=True)
    ordered, order = weights.sort(-1, descending=True)
    before = ordered.cumsum(-1) - ordered  # weight mass of the experts ranked above
    keep_sorted = before < mass * total
    keep_sorted[:, :min_experts] = True
    keep = torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)
    kept = weights * keep
    return kept * (total / kept.sum(-1, keepdim=True).clamp(min=1e-20))


def set_expert_mass(model: nn.Module, mass: float | None) -> list[AdaptiveMoE]:
    """Wraps every MoE layer in AdaptiveMoE at `mass` (None unwraps). Returns the wrappers."""
    wrappers = []
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, AdaptiveMoE):
            if mass is None:
                layer.mlp = mlp.moe
                continue
            mlp.mass = mass
            wrappers.append(mlp)
        elif isinstance(mlp, MoE) and mass is not None:
            layer.mlp = AdaptiveMoE(mlp, mass)
            wrappers.append(layer.mlp)
    return wrappers

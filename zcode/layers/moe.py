"""DeepSeek-V3-style MoE (GLM-4.5+, GLM-5): sigmoid router with bias-corrected group top-k,
routed SwiGLU experts and an always-on shared expert."""

import torch
import torch.nn.functional as F
from torch import nn

from zcode.layers.mlp import GatedMLP


class TopkRouter(nn.Module):
    """noaux_tc routing: choose experts by sigmoid score + correction bias within the best groups,
    weight them by the uncorrected score."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_groups: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.num_experts, self.top_k = num_experts, top_k
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, D] -> weights [T, top_k] fp32, expert ids [T, top_k]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        group_ids = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
        group_keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        expert_keep = group_keep.repeat_interleave(self.num_experts // self.num_groups, dim=1)
        choice = choice.masked_fill(~expert_keep, float("-inf"))
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids


class MoE(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        c = hf_config
        self.gate = TopkRouter(
            c.hidden_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        self.experts = nn.ModuleList(
            GatedMLP(c.hidden_size, c.moe_intermediate_size) for _ in range(c.n_routed_experts)
        )
        self.shared_experts = GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D]
        weights, expert_ids = self.gate(x)  # [T, top_k]
        out = torch.zeros_like(x)
        for expert_id in expert_ids.unique().tolist():
            token_ids, slot = torch.where(expert_ids == expert_id)
            expert_out = self.experts[expert_id](x[token_ids])
            out.index_add_(0, token_ids, expert_out * weights[token_ids, slot, None].to(x.dtype))
        return out + self.shared_experts(x)

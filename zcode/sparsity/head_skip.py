"""Static KV-head pruning: whole GQA groups (one KV head and the query heads that read it) a plan
removes from a layer, so the layer computes fewer heads and caches fewer KV heads.

Importance of a group on calibration text: the mean norm of what its heads add to the residual
stream, ||o_proj[:, group] @ out[group]||, per token (the head-output norm of Michel et al. 2019
with the output projection folded in). A pruned layer is a plain Attention with fewer heads and
sliced weights, so every attention path (cache, RoPE, GQA) stays the dense code.
"""

import torch
from torch import nn

from zcode.layers.attention import Attention


class HeadInfluence:
    """Forward pre-hooks on o_proj of every GQA attention: summed per-group output norms."""

    def __init__(self, model: nn.Module) -> None:
        self.attns = {
            i: layer.self_attn
            for i, layer in enumerate(model.model.layers)
            if type(getattr(layer, "self_attn", None)) is Attention
        }
        first = next(iter(self.attns.values()))
        self.sums = torch.zeros(len(model.model.layers), first.num_kv_heads, dtype=torch.float64)
        self.counts = torch.zeros(len(model.model.layers), dtype=torch.float64)
        self._handles = []

    def __enter__(self) -> "HeadInfluence":
        for i, attn in self.attns.items():
            self._handles.append(attn.o_proj.register_forward_pre_hook(self._hook(i, attn)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, index: int, attn: Attention):
        group = attn.num_heads // attn.num_kv_heads
        width = group * attn.head_dim

        def hook(module, args):
            (x,) = args  # [T, H * Dh]
            for g in range(attn.num_kv_heads):
                cols = slice(g * width, (g + 1) * width)
                part = x[:, cols].float() @ module.weight[:, cols].float().t()  # [T, D]
                self.sums[index, g] += part.norm(dim=-1).sum().double()
            self.counts[index] += x.shape[0]

        return hook

    def scores(self) -> torch.Tensor:
        """[L, KVH] mean output norm per KV group (zeros for layers without GQA attention)."""
        return (self.sums / self.counts.clamp(min=1).unsqueeze(1)).float()


def prune_order(scores: torch.Tensor) -> list[tuple[int, int]]:
    """(layer, kv group) pairs, least important first; a layer keeps at least one group."""
    pairs = [
        (i, g) for i in range(scores.shape[0]) for g in range(scores.shape[1]) if scores[i, g] > 0
    ]
    pairs.sort(key=lambda p: float(scores[p]))
    kept = {i: int((scores[i] > 0).sum()) for i in range(scores.shape[0])}
    order = []
    for i, g in pairs:
        if kept[i] > 1:
            order.append((i, g))
            kept[i] -= 1
    return order


def pruned_attention(attn: Attention, keep_groups: list[int]) -> Attention:
    """A copy of `attn` with only the KV groups in keep_groups (and their query heads)."""
    if not keep_groups:
        raise ValueError("a layer keeps at least one KV group")
    group, dh = attn.num_heads // attn.num_kv_heads, attn.head_dim
    q_rows = torch.cat([torch.arange(g * group * dh, (g + 1) * group * dh) for g in keep_groups])
    kv_rows = torch.cat([torch.arange(g * dh, (g + 1) * dh) for g in keep_groups])
    q_proj, k_proj = attn.q_proj, attn.k_proj
    hidden = q_proj.in_features
    new = Attention(
        hidden,
        group * len(keep_groups),
        len(keep_groups),
        dh,
        interleaved_rope=attn.interleaved_rope,
        qkv_bias=q_proj.bias is not None,
        qk_norm_eps=attn.q_norm.eps if hasattr(attn, "q_norm") else None,
    ).to(q_proj.weight.dtype)
    new.scale = attn.scale
    with torch.no_grad():
        new.q_proj.weight.copy_(q_proj.weight[q_rows])
        new.k_proj.weight.copy_(k_proj.weight[kv_rows])
        new.v_proj.weight.copy_(attn.v_proj.weight[kv_rows])
        new.o_proj.weight.copy_(attn.o_proj.weight[:, q_rows])
        if q_proj.bias is not None:
            new.q_proj.bias.copy_(q_proj.bias[q_rows])
            new.k_proj.bias.copy_(k_proj.bias[kv_rows])
            new.v_proj.bias.copy_(attn.v_proj.bias[kv_rows])
        if hasattr(attn, "q_norm"):
            new.q_norm.load_state_dict(attn.q_norm.state_dict())
            new.k_norm.load_state_dict(attn.k_norm.state_dict())
    return new


def prune_heads(model: nn.Module, drop: list[tuple[int, int]]) -> None:
    """Removes the named (layer, kv group) pairs, in place."""
    by_layer: dict[int, set[int]] = {}
    for i, g in drop:
        by_layer.setdefault(i, set()).add(g)
    layers = model.model.layers
    for i, groups in by_layer.items():
        attn = layers[i].self_attn
        if type(attn) is not Attention:
            raise NotImplementedError(f"head pruning of {type(attn).__name__} (layer {i})")
        keep = [g for g in range(attn.num_kv_heads) if g not in groups]
        layers[i].self_attn = pruned_attention(attn, keep)

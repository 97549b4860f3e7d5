"""Static depth skipping: decoder layers a plan does not run at all, chosen by Block Influence
(ShortGPT, arXiv 2403.03853): BI = 1 - mean cosine(layer input, layer output) on calibration
text; the layers that change the residual stream least go first.

A skipped layer is replaced by SkippedLayer, whose attention caches nothing, so a KV cache built
after the swap allocates no blocks for it.
"""

import torch
from torch import nn


class _NoAttention(nn.Module):
    """Stands in for a skipped layer's attention in `attention_layers()`: caches nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[str, torch.Tensor] = {}

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        return {}


class SkippedLayer(nn.Module):
    """A decoder layer that is not run: the residual stream passes through unchanged."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.self_attn = _NoAttention()
        self.skipped = layer  # kept so the plan can be undone; not called

    def forward(self, x: torch.Tensor, batch, rope) -> torch.Tensor:
        return x


class BlockInfluence:
    """Forward hooks on every decoder layer summing 1 - cos(input, output) per token."""

    def __init__(self, model: nn.Module) -> None:
        self.layers = list(model.model.layers)
        self.sums = torch.zeros(len(self.layers), dtype=torch.float64)
        self.counts = torch.zeros(len(self.layers), dtype=torch.float64)
        self._handles = []

    def __enter__(self) -> "BlockInfluence":
        for i, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_hook(self._hook(i)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, index: int):
        def hook(_module, args, out):
            x = args[0].float()  # [T, D]
            cos = torch.nn.functional.cosine_similarity(x, out.float(), dim=-1)  # [T]
            self.sums[index] += (1 - cos).sum().double()
            self.counts[index] += cos.numel()

        return hook

    def scores(self) -> torch.Tensor:
        """[L] mean BI per layer (higher: the layer matters more)."""
        if not self.counts.all():
            raise ValueError("no activations were recorded: run the model on calibration text")
        return (self.sums / self.counts).float()


def skip_order(scores: torch.Tensor, protect_first: int = 1, protect_last: int = 1) -> list[int]:
    """Layers in the order a plan skips them: lowest BI first; the first and last layers, whose
    removal breaks small models outright, are never offered."""
    num_layers = scores.numel()
    candidates = [i for i in range(protect_first, num_layers - protect_last)]
    return sorted(candidates, key=lambda i: float(scores[i]))


def skip_layers(model: nn.Module, layer_ids: list[int]) -> None:
    """Replaces the named decoder layers by SkippedLayer, in place."""
    layers = model.model.layers
    for i in layer_ids:
        if not 0 <= i < len(layers):
            raise ValueError(f"layer {i} out of range: the model has {len(layers)} layers")
        if not isinstance(layers[i], SkippedLayer):
            layers[i] = SkippedLayer(layers[i])


def restore_layers(model: nn.Module) -> None:
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if isinstance(layer, SkippedLayer):
            layers[i] = layer.skipped

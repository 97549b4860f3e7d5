"""TEAL-style magnitude thresholds: per layer, the quantiles of the scores of the FFN's two linear
inputs (x into gate/up, h = silu(gate) * up into down) measured on calibration text.

The score of input channel k is |x_k| * scale_k: scale is 1 for TEAL (arXiv 2408.14690) and the
L2 norm of the weight row the channel multiplies for WINA (weight-informed, arXiv 2505.19427),
which ranks a channel by the size of its contribution to the output rather than its own size.
A threshold at quantile s zeroes the fraction s of a layer's inputs (pooled over tokens and
channels); the kept inputs are the rows of the transposed weights the sparse kernel reads.
"""

from dataclasses import dataclass

import torch
from torch import nn

from zcode.layers.mlp import GatedMLP

# Sparsity levels the calibration tabulates; a plan picks among them.
LEVELS = tuple(round(0.05 * i, 2) for i in range(20))  # 0.0 .. 0.95
_MAX_SAMPLES = 1 << 20  # per layer and input: torch.quantile's limit is 16M, this is plenty


SCORES = ("teal", "wina")


def channel_scales(mlp: GatedMLP, score: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel score scales of the gate/up input [D] and the down input [I]."""
    if score not in SCORES:
        raise ValueError(f"unknown score {score!r}; known: {', '.join(SCORES)}")
    w_gate, w_up, w_down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    if score == "teal":
        return torch.ones(w_gate.shape[1]), torch.ones(w_down.shape[1])
    # the norm of what channel k adds to the output per unit of input: column k of the weight
    scale_in = torch.cat([w_gate, w_up]).float().norm(dim=0)  # [D]
    scale_mid = w_down.float().norm(dim=0)  # [I]
    return scale_in, scale_mid


@dataclass(frozen=True)
class ThresholdTable:
    score: str
    levels: tuple[float, ...]
    # [L, len(levels)]: |x| below thresh_in[l, i] is dropped at sparsity levels[i]
    thresh_in: torch.Tensor
    thresh_mid: torch.Tensor

    def at(self, layer: int, sparsity_in: float, sparsity_mid: float) -> tuple[float, float]:
        return (
            float(self.thresh_in[layer, self.level_index(sparsity_in)]),
            float(self.thresh_mid[layer, self.level_index(sparsity_mid)]),
        )

    def level_index(self, sparsity: float) -> int:
        for i, level in enumerate(self.levels):
            if abs(level - sparsity) < 1e-6:
                return i
        raise ValueError(f"sparsity {sparsity} is not a calibrated level; known: {self.levels}")


def gated_mlps(model: nn.Module) -> dict[int, GatedMLP]:
    """Decoder layer index -> its dense SwiGLU FFN: the FFNs that take sparsity levels (MoE
    layers and GELU-gated FFNs, a GatedMLP subclass the SiLU kernels do not run, are left out)."""
    return {
        i: layer.mlp
        for i, layer in enumerate(model.model.layers)
        if type(getattr(layer, "mlp", None)) is GatedMLP
    }


class ActivationRecorder:
    """Forward pre-hooks on each GatedMLP's gate_proj and down_proj that keep a random subsample
    of each input's scores per layer (and, if asked, the full inputs for predictor training)."""

    def __init__(
        self, model: nn.Module, score: str = "teal", keep_inputs: bool = False, seed: int = 0
    ) -> None:
        self.mlps = gated_mlps(model)
        self.score = score
        self.scales = {i: channel_scales(mlp, score) for i, mlp in self.mlps.items()}
        self.abs_in: dict[int, list[torch.Tensor]] = {i: [] for i in self.mlps}
        self.abs_mid: dict[int, list[torch.Tensor]] = {i: [] for i in self.mlps}
        self.inputs: dict[int, list[torch.Tensor]] = {i: [] for i in self.mlps}
        self.mids: dict[int, list[torch.Tensor]] = {i: [] for i in self.mlps}
        self.keep_inputs = keep_inputs
        self.generator = torch.Generator().manual_seed(seed)
        self._handles = []

    def __enter__(self) -> "ActivationRecorder":
        for i, mlp in self.mlps.items():
            self._handles.append(mlp.gate_proj.register_forward_pre_hook(self._hook(i, "in")))
            self._handles.append(mlp.down_proj.register_forward_pre_hook(self._hook(i, "mid")))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _hook(self, layer: int, which: str):
        def hook(_module, args):
            (x,) = args  # [T, K]
            x = x.detach().float()
            if self.keep_inputs:
                (self.inputs if which == "in" else self.mids)[layer].append(x.clone())
            scale = self.scales[layer][0 if which == "in" else 1]
            flat = (x.abs() * scale).flatten()
            keep = min(flat.numel(), _MAX_SAMPLES // 8)
            idx = torch.randperm(flat.numel(), generator=self.generator)[:keep]
            (self.abs_in if which == "in" else self.abs_mid)[layer].append(flat[idx])

        return hook

    def table(self, levels: tuple[float, ...] = LEVELS) -> ThresholdTable:
        q = torch.tensor(levels, dtype=torch.float64)
        rows_in, rows_mid = [], []
        for i in sorted(self.mlps):
            rows_in.append(_quantiles(self.abs_in[i], q))
            rows_mid.append(_quantiles(self.abs_mid[i], q))
        return ThresholdTable(self.score, levels, torch.stack(rows_in), torch.stack(rows_mid))


def _quantiles(chunks: list[torch.Tensor], q: torch.Tensor) -> torch.Tensor:
    if not chunks:
        raise ValueError("no activations were recorded: run the model on calibration text first")
    values = torch.cat(chunks).double()
    if values.numel() > _MAX_SAMPLES:
        values = values[torch.randperm(values.numel())[:_MAX_SAMPLES]]
    out = torch.quantile(values, q)
    out[q == 0] = -1.0  # level 0 keeps everything, zeros included
    return out.float()

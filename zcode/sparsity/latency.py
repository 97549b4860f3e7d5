"""Per-token decode latency: measured on the engine, and predicted from the bytes of weights a
plan reads per token with a two-parameter fit (fixed overhead + ms per MB) made at calibration.

Until a shared cost model is committed this is the sparsity planner's own model; the bytes side
is exact (it counts the weight rows each module reads), the fit absorbs dispatch overhead and
effective bandwidth on this machine.
"""

import statistics
import time

import torch
from torch import nn

from zcode.layers.mlp import GatedMLP
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams
from zcode.sparsity.artifact import LatencyFit
from zcode.sparsity.layer_skip import SkippedLayer
from zcode.sparsity.predictor import PredictedMLP
from zcode.sparsity.sparse_mlp import SparseMLP


def weight_mb_per_token(model: nn.Module, ffn_density: float = 1.0) -> float:
    """MB of weights a batch-1 decode step reads under a plan with this FFN density (fraction of
    FFN weight rows read), whatever level the modules are at now: every linear of every layer
    that runs, the FFNs scaled, the LM head, one embedding row."""
    total = 0.0
    for layer in model.model.layers:
        if isinstance(layer, SkippedLayer):
            continue
        mlp = getattr(layer, "mlp", None)
        ffn_ids = set()
        if isinstance(mlp, (SparseMLP, GatedMLP, PredictedMLP)):
            ffn_ids = {id(p) for p in mlp.parameters()}
            total += ffn_density * _ffn_bytes(mlp)
        for module in layer.modules():
            if isinstance(module, nn.Linear) and id(module.weight) not in ffn_ids:
                total += module.weight.nbytes
    total += model.lm_head.weight.nbytes
    total += model.model.embed_tokens.weight[0].nbytes
    return total / 1e6


def _ffn_bytes(mlp: nn.Module) -> int:
    """Bytes of the three FFN matrices, whatever layout the module keeps them in."""
    if isinstance(mlp, SparseMLP):
        return mlp.w_gate_up_t.nbytes + mlp.w_down_t.nbytes
    if isinstance(mlp, PredictedMLP):
        mlp = mlp.dense
    return sum(lin.weight.nbytes for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))


def decode_ms_per_token(llm: LLM, prompt_ids: list[int], num_tokens: int = 16) -> float:
    """Median wall ms between consecutive generated tokens of one greedy request (prefill
    excluded)."""
    params = SamplingParams(max_tokens=num_tokens + 1, temperature=0, ignore_eos=True)
    stamps = []
    for _ in llm.stream(prompt_ids, params):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return 1e3 * statistics.median(gaps)


def fit_latency(points: list[tuple[float, float]]) -> LatencyFit:
    """Least-squares line through (MB per token, ms per token) points."""
    if len(points) < 2:
        raise ValueError("a latency fit needs at least two plans")
    mb = torch.tensor([p[0] for p in points], dtype=torch.float64)
    ms = torch.tensor([p[1] for p in points], dtype=torch.float64)
    design = torch.stack([torch.ones_like(mb), mb], dim=1)
    coef = torch.linalg.lstsq(design, ms.unsqueeze(1)).solution.squeeze(1)
    return LatencyFit(overhead_ms=float(coef[0]), ms_per_mb=float(coef[1]))

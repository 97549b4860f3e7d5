"""Per-token decode latency: measured on the engine, and predicted from the bytes of weights a
plan reads per token with a three-parameter fit made at calibration: fixed overhead, ms per MB
read by dense kernels, ms per MB of FFN rows read by the row-skipping kernel.

The bytes side is exact: it counts the weight rows each kernel reads, including the kernel's
fallback to a dense GEMM when a matrix keeps more than `dense_fraction` of its rows (a level
that drops 10% of gate/up inputs reads all of gate/up). The fit absorbs dispatch overhead and
each kernel's effective bandwidth on this machine; points are the fastest of several
interleaved repeats, since other processes only ever make a step slower.
"""

import statistics
import time

import numpy as np
from scipy.optimize import nnls
from torch import nn

from zcode.layers.mlp import GatedMLP
from zcode.llm import LLM
from zcode.sampling_params import SamplingParams
from zcode.sparsity.apply import set_ffn_level
from zcode.sparsity.artifact import FFNLevel, LatencyFit, SparsityArtifact
from zcode.sparsity.layer_skip import SkippedLayer
from zcode.sparsity.predictor import PredictedMLP
from zcode.sparsity.sparse_mlp import DEFAULT_DENSE_FRACTION, SparseMLP


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


def kernel_mb_per_token(
    model: nn.Module,
    sparsity_in: float,
    sparsity_mid: float,
    dense_fraction: float = DEFAULT_DENSE_FRACTION,
) -> tuple[float, float]:
    """(MB read by dense kernels, MB of FFN rows read by the row-skipping kernel) of a batch-1
    decode step at this TEAL level: a matrix keeping more than `dense_fraction` of its input rows
    runs as a dense GEMM (SparseMLP's fallback) and reads all of them."""
    total = weight_mb_per_token(model, 1.0)
    sparse = 0.0
    for layer in model.model.layers:
        mlp = getattr(layer, "mlp", None)
        if isinstance(layer, SkippedLayer) or not isinstance(mlp, (SparseMLP, GatedMLP)):
            continue
        gate_up_mb, down_mb = (b / 1e6 for b in _ffn_matrix_bytes(mlp))
        for mb, kept in ((gate_up_mb, 1 - sparsity_in), (down_mb, 1 - sparsity_mid)):
            if kept <= dense_fraction:
                total -= mb
                sparse += kept * mb
    return total, sparse


def _ffn_bytes(mlp: nn.Module) -> int:
    """Bytes of the three FFN matrices, whatever layout the module keeps them in."""
    if isinstance(mlp, PredictedMLP):
        mlp = mlp.dense
    return sum(_ffn_matrix_bytes(mlp))


def _ffn_matrix_bytes(mlp: nn.Module) -> tuple[int, int]:
    """(bytes of gate and up together, bytes of down)."""
    if isinstance(mlp, SparseMLP):
        return mlp.w_gate_up_t.nbytes, mlp.w_down_t.nbytes
    return mlp.gate_proj.weight.nbytes + mlp.up_proj.weight.nbytes, mlp.down_proj.weight.nbytes


def decode_ms_per_token(llm: LLM, prompt_ids: list[int], num_tokens: int = 16) -> float:
    """Median wall ms between consecutive generated tokens of one greedy request (prefill
    excluded)."""
    params = SamplingParams(max_tokens=num_tokens + 1, temperature=0, ignore_eos=True)
    stamps = []
    for _ in llm.stream(prompt_ids, params):
        stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return 1e3 * statistics.median(gaps)


def measure_latency_points(
    llm: LLM,
    artifact: SparsityArtifact,
    levels: list[FFNLevel],
    prompt_ids: list[int],
    repeats: int = 3,
    num_tokens: int = 16,
) -> list[tuple[float, float, float]]:
    """(dense MB, sparse MB, ms per token) of each level: the fastest of `repeats` runs,
    interleaved across levels so drifting load hits every level alike. Leaves the model at the
    last level."""
    ms = {lv: [] for lv in levels}
    for _ in range(repeats):
        for lv in levels:
            set_ffn_level(llm.model, artifact, lv.sparsity_in, lv.sparsity_mid)
            ms[lv].append(decode_ms_per_token(llm, prompt_ids, num_tokens))
    return [
        (*kernel_mb_per_token(llm.model, lv.sparsity_in, lv.sparsity_mid), min(ms[lv]))
        for lv in levels
    ]


def fit_latency(points: list[tuple[float, float, float]]) -> LatencyFit:
    """Non-negative least squares on relative error through (dense MB, sparse MB, ms per token)
    points: no coefficient can come out negative (a time per byte below zero is noise, not a
    property of the machine), and a 30 ms point weighs as much as a 60 ms one."""
    if len(points) < 3 or not any(p[1] for p in points) or len({p[0] for p in points}) < 2:
        raise ValueError(
            "a latency fit needs at least three levels, one of them sparse and two with "
            "different dense bytes"
        )
    design = np.array([[1.0, dense_mb, sparse_mb] for dense_mb, sparse_mb, _ in points])
    ms = np.array([p[2] for p in points])
    coef, _ = nnls(design / ms[:, None], np.ones_like(ms))
    return LatencyFit(
        overhead_ms=float(coef[0]), ms_per_mb=float(coef[1]), sparse_ms_per_mb=float(coef[2])
    )

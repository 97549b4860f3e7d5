"""A synthetic cost model for tests of what reads it: every step costs `step_ms`, every MB of
weights `mb_ms` (dense float linears, quantized linears, GGUF blocks and sparse FFN rows, fp32 or
int8, alike), nothing else."""

from zcode.hardware.cost_model import GGUF_KINDS, CostModel


def synthetic_coefficients(mb_ms: float, step_ms: float = 1.0) -> dict[str, float]:
    free = ("seqs", "kv:MB", "attn:GFLOP", "kv-paged:MB", "kv-paged:calls", "kv-paged:rows")
    free += ("moe-fused:layers",)
    coefficients = {"step": step_ms, **dict.fromkeys(free, 0.0)}
    kinds = ("dense-float32", "sparse-float32", "sparse-int8", "int8", "int4", "w8a8", "w4a8")
    for kind in kinds + GGUF_KINDS:
        coefficients |= {f"{kind}:MB": mb_ms, f"{kind}:calls": 0.0, f"{kind}:GFLOP": 0.0}
        coefficients[f"{kind}:gemv-GFLOP"] = 0.0
    return coefficients


def synthetic_cost_model(mb_ms: float, step_ms: float = 1.0) -> CostModel:
    coefficients = synthetic_coefficients(mb_ms, step_ms)
    return CostModel(coefficients, coefficients, "test")

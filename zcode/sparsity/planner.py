"""SLA-driven plans: for `generate(..., max_latency_ms=...)`, the calibrated FFN level whose
predicted decode ms per step meets the target at the smallest calibrated quality loss.

Predicted ms comes from the artifact's latency fit over the bytes each kernel reads per token at
the level (dense GEMMs and the row-skipping kernel stream at different rates); the
generation is timed step by step, and each output's `plan` reports both. When no level meets the
target the fastest one runs and the report says `target_met: False`.
"""

import statistics
import time

from zcode.engine.request_output import RequestOutput
from zcode.errors import ValidationError
from zcode.sampling_params import SamplingParams
from zcode.sparsity.apply import set_ffn_level
from zcode.sparsity.artifact import FFNLevel, SparsityArtifact
from zcode.sparsity.latency import kernel_mb_per_token
from zcode.sparsity.sparse_mlp import SparseMLP


def predicted_ms(model, artifact: SparsityArtifact, level: FFNLevel) -> float:
    if artifact.latency is None:
        raise ValidationError("this sparsity artifact has no latency fit: run zcode calibrate")
    return artifact.latency.predict_ms(
        *kernel_mb_per_token(model, level.sparsity_in, level.sparsity_mid)
    )


def level_name(level: FFNLevel) -> str:
    return f"ffn in {level.sparsity_in:g} / mid {level.sparsity_mid:g}"


def level_salt(level: FFNLevel) -> str:
    """The prefix-cache salt of KV computed at this FFN level."""
    return f"ffn level: {level_name(level)}"


def choose_level(model, artifact: SparsityArtifact, max_latency_ms: float) -> tuple[FFNLevel, bool]:
    """(level, whether its prediction meets the target)."""
    if max_latency_ms <= 0:
        raise ValidationError(f"max_latency_ms must be positive, got {max_latency_ms}")
    meeting = [lv for lv in artifact.levels if predicted_ms(model, artifact, lv) <= max_latency_ms]
    if meeting:
        return min(meeting, key=lambda lv: (lv.ppl_ratio, -lv.flops_skipped)), True
    return max(artifact.levels, key=lambda lv: lv.flops_skipped), False


def generate_within(
    llm, token_lists: list[list[int]], params: SamplingParams, max_latency_ms: float
) -> list[RequestOutput]:
    artifact = llm.sparsity
    if artifact is None:
        raise ValidationError("max_latency_ms plans from a sparsity artifact: LLM(..., sparsity=)")
    model = llm.model
    previous = _current_thresholds(model)
    level, target_met = choose_level(model, artifact, max_latency_ms)
    set_ffn_level(model, artifact, level.sparsity_in, level.sparsity_mid)
    engine = llm.engine
    previous_salt = engine.kv_salt
    if _current_thresholds(model) != previous:
        # This level's KV is not the usual one: the prefix cache keeps the two apart.
        engine.kv_salt = level_salt(level)
    try:
        seqs = [engine.add_request(ids, params) for ids in token_lists]
        finished: dict[str, RequestOutput] = {}
        step_ms, prefilled = [], False
        while engine.has_unfinished():
            start = time.perf_counter()
            outs = engine.step()
            if prefilled:  # decode steps only: every request's prompt is in the cache
                step_ms.append(1e3 * (time.perf_counter() - start))
            prefilled = all(s.num_computed_tokens >= s.num_prompt_tokens for s in seqs)
            for out in outs:
                if out.finished:
                    finished[out.request_id] = out
    finally:
        _restore_thresholds(model, previous)
        engine.kv_salt = previous_salt
    report = {
        "plan": level_name(level),
        "ffn_flops_skipped": round(level.flops_skipped, 4),
        "max_latency_ms": max_latency_ms,
        "predicted_ms_per_step": round(predicted_ms(model, artifact, level), 3),
        "measured_ms_per_step": round(statistics.median(step_ms), 3) if step_ms else None,
        "predicted_ppl_ratio": round(level.ppl_ratio, 4),
        "target_met": target_met,
    }
    results = [finished[seq.request_id] for seq in seqs]
    for out in results:
        out.plan = report
    return results


def _current_thresholds(model) -> dict[int, tuple[float, float]]:
    return {
        i: (layer.mlp.thresh_in, layer.mlp.thresh_mid)
        for i, layer in enumerate(model.model.layers)
        if isinstance(getattr(layer, "mlp", None), SparseMLP)
    }


def _restore_thresholds(model, thresholds: dict[int, tuple[float, float]]) -> None:
    layers = model.model.layers
    for i, layer in enumerate(layers):
        if isinstance(getattr(layer, "mlp", None), SparseMLP):
            layer.mlp.set_thresholds(*thresholds.get(i, (-1.0, -1.0)))

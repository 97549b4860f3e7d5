"""A calibration artifact for a tiny model without calibrating it, for tests of what reads one
(the planner, the executor, the server, the router)."""

import torch

from zcode.sparsity.artifact import FFNLevel, SparsityArtifact, fingerprint
from zcode.sparsity.thresholds import ThresholdTable


def synthetic_artifact(
    model,
    levels: list[FFNLevel],
    thresh_in: float | list[float] = -1.0,
    thresh_mid: float | list[float] = -1.0,
    head_scores: torch.Tensor | None = None,
    **fields,
) -> SparsityArtifact:
    """`levels` as calibration would have measured them; thresholds the same in every layer, one
    per sparsity the levels name (sorted; a float: the same for all; negative keeps every input);
    `head_scores` [L, KV heads] ablation ratios (default zeros); `fields`: the artifact's others
    (router, head_count_ratios)."""
    n = len(model.model.layers)
    sparsities = tuple(sorted({s for lv in levels for s in (lv.sparsity_in, lv.sparsity_mid)}))

    def per_layer(thresh: float | list[float]) -> torch.Tensor:  # [L, len(sparsities)]
        row = [thresh] * len(sparsities) if isinstance(thresh, float) else thresh
        return torch.tensor(row, dtype=torch.float32).expand(n, len(sparsities)).contiguous()

    table = ThresholdTable("teal", sparsities, per_layer(thresh_in), per_layer(thresh_mid))
    kv_heads = model.config.num_key_value_heads
    scores = torch.zeros(n, kv_heads) if head_scores is None else head_scores
    return SparsityArtifact(fingerprint(model), table, levels, torch.zeros(n), scores, **fields)

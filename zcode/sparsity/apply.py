"""Turning a calibration artifact and an ExecutionPlan into swapped modules: SparseMLP for the
FFNs, SkippedLayer for skipped layers, narrower Attention for pruned KV groups; and the MoE
layers' expert limits.

The plan carries the FFN levels, pruned heads and expert limits in `extras` (ffn_sparsity_in,
ffn_sparsity_mid, ffn_weights: the rows the sparse FFNs read when not the loaded ones, drop_heads
as "layer:group,...", experts_per_token, moe_mass). A plan that changes what the KV
cache holds (skipped layers, pruned heads) is applied before the engine sizes its cache:
`apply_to_llm` rebuilds the engine.
"""

import torch
from torch import nn

from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.layers.mlp import GatedMLP
from zcode.layers.moe import set_experts_per_token
from zcode.llm import LLM
from zcode.sparsity.artifact import SparsityArtifact
from zcode.sparsity.head_skip import prune_heads, prune_order
from zcode.sparsity.layer_skip import SkippedLayer, restore_layers, skip_layers, skip_order
from zcode.sparsity.predictor import PredictedMLP, load_predictors
from zcode.sparsity.sparse_mlp import SparseMLP


def make_plan(
    artifact: SparsityArtifact,
    sparsity_in: float = 0.0,
    sparsity_mid: float = 0.0,
    num_skip_layers: int = 0,
    num_drop_heads: int = 0,
    moe_mass: float | None = None,
    predictor_keep: float | None = None,
    experts_per_token: int | None = None,
) -> ExecutionPlan:
    """A plan from the artifact's rankings: the least influential layers and KV groups go;
    `experts_per_token` runs that many of each token's routed experts (its highest-weighted),
    `moe_mass` only as many as reach that share of its routing weight;
    `predictor_keep` runs the FFNs on the neuron blocks the trained predictors pick (that
    fraction of them) instead of thresholds."""
    level = artifact.level(sparsity_in, sparsity_mid)
    skipped = tuple(sorted(skip_order(artifact.layer_scores)[:num_skip_layers]))
    drop = [p for p in prune_order(artifact.head_scores) if p[0] not in skipped][:num_drop_heads]
    extras = [("ffn_sparsity_in", str(sparsity_in)), ("ffn_sparsity_mid", str(sparsity_mid))]
    if drop:
        extras.append(("drop_heads", ",".join(f"{i}:{g}" for i, g in sorted(drop))))
    if moe_mass is not None:
        extras.append(("moe_mass", str(moe_mass)))
    if experts_per_token is not None:
        extras.append(("experts_per_token", str(experts_per_token)))
    density = max(1.0 - level.flops_skipped, 1e-3)
    name = f"ffn{sparsity_in:g}/{sparsity_mid:g}-skip{num_skip_layers}-heads{num_drop_heads}"
    if predictor_keep is not None:
        if level.flops_skipped:
            raise ValueError("a plan uses FFN thresholds or the predictor, not both")
        if str(predictor_keep) not in (artifact.predictor or {}):
            raise ValidationError(f"the artifact has no predictor trained for {predictor_keep}")
        extras.append(("ffn_predictor_keep", str(predictor_keep)))
        density = predictor_keep
        name = f"predictor{predictor_keep:g}-skip{num_skip_layers}-heads{num_drop_heads}"
    return ExecutionPlan(
        name=name,
        ffn_density=density,
        skip_layers=skipped,
        extras=tuple(sorted(extras)),
    )


def _extras(plan: ExecutionPlan) -> dict[str, str]:
    return dict(plan.extras)


def expert_limits(plan: ExecutionPlan) -> tuple[int | None, float | None]:
    """(routed experts per token, share of routing weight) the plan's MoE layers run; None: all."""
    extras = _extras(plan)
    count, mass = extras.get("experts_per_token"), extras.get("moe_mass")
    return (None if count is None else int(count)), (None if mass is None else float(mass))


def drop_heads_of(plan: ExecutionPlan) -> list[tuple[int, int]]:
    text = _extras(plan).get("drop_heads", "")
    return [tuple(int(v) for v in pair.split(":")) for pair in text.split(",") if pair]


def apply_plan(model: nn.Module, artifact: SparsityArtifact, plan: ExecutionPlan) -> None:
    """Swaps the model's modules to run `plan` (in place; dense modules it names are replaced)."""
    artifact.check_model(model)
    extras = _extras(plan)
    s_in = float(extras.get("ffn_sparsity_in", 0.0))
    s_mid = float(extras.get("ffn_sparsity_mid", 0.0))
    set_ffn_level(model, artifact, s_in, s_mid, extras.get("ffn_weights", "fp32"))
    if "ffn_predictor_keep" in extras:
        keep = extras["ffn_predictor_keep"]
        state = artifact.predictor[keep]
        predictors = load_predictors(state, model.config.hidden_size)
        for i, layer in enumerate(model.model.layers):
            if i in predictors and type(layer.mlp) is GatedMLP:
                layer.mlp = PredictedMLP(layer.mlp, predictors[i], float(keep))
    prune_heads(model, drop_heads_of(plan))
    set_experts_per_token(model, *expert_limits(plan))
    skip_layers(model, list(plan.skip_layers))


def set_ffn_level(
    model: nn.Module,
    artifact: SparsityArtifact,
    sparsity_in: float,
    sparsity_mid: float,
    weights: str = "fp32",
) -> None:
    """Moves every dense FFN to the level, reading `weights` rows (fp32: the loaded weights, or
    int8), swapping GatedMLP for SparseMLP on first use."""
    if sparsity_in or sparsity_mid or weights != "fp32":
        sparse_ffns(model, artifact)
    thresholds = ffn_thresholds(model, artifact, sparsity_in, sparsity_mid)  # [L, 2]
    for layer, (thresh_in, thresh_mid) in zip(_all_layers(model), thresholds.tolist()):
        if isinstance(layer.mlp, SparseMLP):
            layer.mlp.set_thresholds(thresh_in, thresh_mid)
            layer.mlp.set_weight_format(weights)


def ffn_thresholds(
    model: nn.Module, artifact: SparsityArtifact, sparsity_in: float, sparsity_mid: float
) -> torch.Tensor:
    """[L, 2] (t_in, t_mid) of each layer's FFN at this level; -1 (keep all) at the dense level
    and for FFNs that have no level (MoE layers)."""
    dense = sparsity_in == 0 and sparsity_mid == 0
    return torch.tensor(
        [
            (-1.0, -1.0)
            if dense or not _has_level(layer.mlp)
            else artifact.table.at(i, sparsity_in, sparsity_mid)
            for i, layer in enumerate(_all_layers(model))
        ]
    )


def sparse_ffns(model: nn.Module, artifact: SparsityArtifact) -> list[SparseMLP | None]:
    """Each decoder layer's FFN as a SparseMLP (a GatedMLP is swapped for one at the dense
    level: same outputs), in layer order; None for FFNs that have no level (MoE layers)."""
    for layer in _all_layers(model):
        if type(layer.mlp) is GatedMLP:
            layer.mlp = SparseMLP(layer.mlp, -1.0, -1.0, artifact.table.score)
    return [layer.mlp if isinstance(layer.mlp, SparseMLP) else None for layer in _all_layers(model)]


def _has_level(mlp: nn.Module) -> bool:
    return type(mlp) is GatedMLP or isinstance(mlp, SparseMLP)


def remove_sparsity(model: nn.Module) -> None:
    """Back to the dense FFNs and all layers (pruned heads stay pruned: their weights are gone)."""
    restore_layers(model)
    set_experts_per_token(model, None)
    for layer in model.model.layers:
        if isinstance(getattr(layer, "mlp", None), SparseMLP):
            layer.mlp = layer.mlp.to_dense()
        elif isinstance(getattr(layer, "mlp", None), PredictedMLP):
            layer.mlp = layer.mlp.dense


def _all_layers(model: nn.Module) -> list[nn.Module]:
    """Decoder layers, looking through SkippedLayer (a skipped layer's FFN keeps its level)."""
    return [
        layer.skipped if isinstance(layer, SkippedLayer) else layer for layer in model.model.layers
    ]


def apply_to_llm(llm: LLM, artifact: SparsityArtifact, plan: ExecutionPlan) -> None:
    """Applies `plan` to a loaded LLM; rebuilds its engine (and KV cache) when the plan skips
    layers or heads, so skipped work gets no KV blocks."""
    apply_plan(llm.model, artifact, plan)
    if plan.skip_layers or drop_heads_of(plan):
        from zcode.engine.llm_engine import LLMEngine

        llm.engine = LLMEngine(llm.model, llm.tokenizer, llm.config)


DEFAULT_MAX_PPL_RATIO = 1.01  # the default plan's quality budget on calibration text


def apply_default_plan(model: nn.Module, path) -> SparsityArtifact:
    """Loads an artifact and applies its default plan: the FFN level that skips the most FLOPs
    within 1% calibration perplexity. Returns the artifact."""
    artifact = SparsityArtifact.load(path)
    level = artifact.best_level(DEFAULT_MAX_PPL_RATIO)
    apply_plan(model, artifact, make_plan(artifact, level.sparsity_in, level.sparsity_mid))
    return artifact

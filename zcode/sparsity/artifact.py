"""The calibration artifact `zcode calibrate` writes and generate/ppl/serve load: thresholds,
layer and head importance, the candidate plans' measured quality, the FFN block predictors, the
routing predictor (zcode.harness.router), the quality of fewer routed experts per token (MoE
models) and the precision sensitivity profile
(zcode.quant.sensitivity), for one model. Latency is the hardware cost
model's (zcode.hardware.cost_model): an older artifact's "latency" fit is ignored.

Stored with torch.save as plain tensors and builtins, read back with weights_only=True.
"""

import hashlib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

from zcode.errors import ValidationError
from zcode.hardware.probe import default_cache_dir
from zcode.sparsity.thresholds import ThresholdTable

FORMAT = "zcode-sparsity/1"


@dataclass(frozen=True)
class FFNLevel:
    """One candidate FFN sparsity level and what calibration measured for it."""

    sparsity_in: float  # fraction of gate/up inputs dropped
    sparsity_mid: float  # fraction of down inputs dropped
    flops_skipped: float  # measured fraction of FFN multiply-adds skipped per token
    ppl_ratio: float  # perplexity / dense perplexity on calibration text
    # {weight format: ppl_ratio at this level with the FFNs reading that format's rows}, e.g.
    # {"int8": ...} (zcode.sparsity.sparse_mlp.WEIGHT_FORMATS); empty in older artifacts
    weight_ppl_ratios: dict[str, float] = field(default_factory=dict)


@dataclass
class SparsityArtifact:
    fingerprint: str
    table: ThresholdTable
    levels: list[FFNLevel]
    layer_scores: torch.Tensor  # [L] block influence
    head_scores: torch.Tensor  # [L, KVH] perplexity ratio with each KV group removed
    # {k: perplexity ratio with the k least important groups removed together}; empty in an
    # artifact written before it was measured
    head_count_ratios: dict[int, float] = field(default_factory=dict)
    # {k: perplexity ratio with every MoE layer running each token's k highest-weighted routed
    # experts of its top_k}; empty for a dense model or an artifact written before it was
    # measured
    expert_count_ratios: dict[int, float] = field(default_factory=dict)
    predictor: dict | None = None  # FFNPredictor.state() and its held-out metrics
    notes: dict = field(default_factory=dict)
    # zcode.harness.router.Router.state(); None when calibration ran without per-request depth
    router: dict | None = None
    # zcode.quant.sensitivity.profile_sensitivity's report of the units outside the leveled
    # FFNs (attention, lm_head): what precision variants are built from; None in an artifact
    # written before calibration profiled them
    sensitivity: dict | None = None

    def level(self, sparsity_in: float, sparsity_mid: float) -> FFNLevel:
        for lv in self.levels:
            if (lv.sparsity_in, lv.sparsity_mid) == (sparsity_in, sparsity_mid):
                return lv
        raise ValidationError(
            f"FFN level ({sparsity_in}, {sparsity_mid}) was not calibrated; known: "
            + ", ".join(f"({lv.sparsity_in}, {lv.sparsity_mid})" for lv in self.levels)
        )

    def best_level(self, max_ppl_ratio: float) -> FFNLevel:
        """The level skipping most FLOPs within a calibration perplexity budget."""
        ok = [lv for lv in self.levels if lv.ppl_ratio <= max_ppl_ratio]
        return max(ok, key=lambda lv: lv.flops_skipped)

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        blob = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "table": {
                "score": self.table.score,
                "levels": list(self.table.levels),
                "thresh_in": self.table.thresh_in,
                "thresh_mid": self.table.thresh_mid,
            },
            "levels": [asdict(lv) for lv in self.levels],
            "layer_scores": self.layer_scores,
            "head_scores": self.head_scores,
            "head_count_ratios": self.head_count_ratios,
            "expert_count_ratios": self.expert_count_ratios,
            "predictor": self.predictor,
            "notes": self.notes,
            "router": self.router,
            "sensitivity": self.sensitivity,
        }
        torch.save(blob, path)

    @classmethod
    def load(cls, path: str | Path) -> "SparsityArtifact":
        path = Path(path)
        if not path.is_file():
            raise ValidationError(f"{path}: no such sparsity artifact (write one: zcode calibrate)")
        try:
            blob = torch.load(path, weights_only=True)
        except Exception as e:
            raise ValidationError(f"{path}: not a sparsity artifact ({e})") from e
        if not isinstance(blob, dict) or blob.get("format") != FORMAT:
            raise ValidationError(f"{path}: not a {FORMAT} artifact")
        t = blob["table"]
        return cls(
            fingerprint=blob["fingerprint"],
            table=ThresholdTable(t["score"], tuple(t["levels"]), t["thresh_in"], t["thresh_mid"]),
            levels=[FFNLevel(**lv) for lv in blob["levels"]],
            layer_scores=blob["layer_scores"],
            head_scores=blob["head_scores"],
            head_count_ratios=blob.get("head_count_ratios", {}),
            expert_count_ratios=blob.get("expert_count_ratios", {}),
            predictor=blob["predictor"],
            notes=blob["notes"],
            router=blob.get("router"),
            sensitivity=blob.get("sensitivity"),
        )

    def check_model(self, model: nn.Module) -> None:
        if fingerprint(model) != self.fingerprint:
            raise ValidationError(
                "this sparsity artifact was calibrated for another model (fingerprint "
                f"{self.fingerprint}, this model {fingerprint(model)}): run zcode calibrate"
            )


def fingerprint(model: nn.Module) -> str:
    """Identifies a model's weights: config shape plus the bytes of two weight slices (bytes, not
    a float sum: a sum's rounding depends on the thread count, so the same model got another
    fingerprint under --threads 1)."""
    c = model.config
    layer = model.model.layers[0]
    digest = hashlib.sha256(repr([c.model_type, c.num_hidden_layers, c.hidden_size]).encode())
    digest.update(repr(c.vocab_size).encode())
    for weight in (model.model.embed_tokens.weight, layer.self_attn.q_proj.weight):
        digest.update(weight.detach()[:64].float().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def default_path(model: nn.Module) -> Path:
    """<user cache>/sparsity-<fingerprint>.pt (the cache dir of the hardware probe)."""
    return default_cache_dir() / f"sparsity-{fingerprint(model)}.pt"

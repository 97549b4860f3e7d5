"""The executor: the one code that moves the model to a plan (precision variant modules, FFN
level and the rows the sparse FFNs read) and declares that plan to the model runner, so compiled
decode keys its graphs by the plan's signature and re-reads the model's tensors at every change.
The engine calls it: each request carries its plan (`Sequence.plan`), and a step runs its rows
grouped by what must be model state, their precision and FFN rows (`group_key`), one forward per
group, moving the model to each group's plan first. Within a group FFN levels and the routed
experts a MoE layer runs are per token (`row_settings`: each SparseMLP takes a threshold per
token, each MoE layer an expert count), and skipped layers and KV heads per row
(LLMEngine.add_request).
"""

import contextlib
import dataclasses

import torch

from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.harness.planner import quantizes_ffn

FFN_LEVEL = ("ffn_sparsity_in", "ffn_sparsity_mid")  # the plan extras that name its FFN level
FFN_WEIGHTS = "ffn_weights"  # the plan extra naming the rows sparse FFNs read (absent: as loaded)
EXPERTS = "experts_per_token"  # the plan extra naming the routed experts a token runs (absent: all)
EXPERT_MASS = "moe_mass"  # the plan extra naming the share of routing weight they reach


@dataclasses.dataclass
class RowSettings:
    """What the rows of one forward set for themselves (None: the model's setting for all):
    FFN thresholds of each layer's SparseMLP, routed experts per token of each MoE layer."""

    sparse_ffns: list | None = None  # each layer's SparseMLP or None
    ffn_thresholds: torch.Tensor | None = None  # [B, L, 2]
    moes: list = dataclasses.field(default_factory=list)
    experts_per_token: torch.Tensor | None = None  # [B] int64

    @contextlib.contextmanager
    def bound(self, query_lens: list[int]):
        """Inside, the model runs each row's settings on its `query_lens` tokens."""
        from zcode.layers.moe import tokens_with_experts
        from zcode.sparsity.sparse_mlp import tokens_at_levels

        repeats = torch.tensor(query_lens)
        with contextlib.ExitStack() as stack:
            if self.ffn_thresholds is not None:
                per_token = self.ffn_thresholds.repeat_interleave(repeats, dim=0)  # [T, L, 2]
                stack.enter_context(tokens_at_levels(self.sparse_ffns, per_token.transpose(0, 1)))
            if self.experts_per_token is not None:
                counts = self.experts_per_token.repeat_interleave(repeats)  # [T]
                stack.enter_context(tokens_with_experts(self.moes, counts))
            yield


class PlanExecutor:
    def __init__(self, engine, variants=None, sparsity=None, default: ExecutionPlan | None = None):
        """`variants`: zcode.quant.variants.PrecisionVariants; `sparsity`: a SparsityArtifact;
        `default`: the plan of requests that name none (its KV is the prefix cache's unsalted
        KV)."""
        self.engine, self.variants, self.sparsity = engine, variants, sparsity
        self.default = default or engine.runner.plan
        self._sparse_ffns: list | None = None  # the modules row_settings last bound

    def group_key(self, plan: ExecutionPlan) -> str:
        """Rows whose plans share this key run in one forward: the plan less what is per row
        (skips; the experts per token; the FFN level, when an artifact gives levels; the rows
        the FFNs read stay: they are model state)."""
        plan = plan.without_skips()
        per_row = (EXPERTS, *FFN_LEVEL) if self.sparsity is not None else (EXPERTS,)
        extras = tuple((k, v) for k, v in plan.extras if k not in per_row)
        if self.sparsity is not None:
            plan = dataclasses.replace(plan, ffn_density=1.0)
        return dataclasses.replace(plan, extras=extras).signature()

    def row_settings(self, plans: list[ExecutionPlan]) -> RowSettings | None:
        """For one forward of requests with these plans (one group_key): None when they share
        their FFN level and experts per token (the model's, once the group's plan is applied),
        else each row's where they differ."""
        settings = RowSettings()
        levels = [_ffn_level(plan) for plan in plans]
        if len(set(levels)) > 1:
            from zcode.sparsity.apply import ffn_thresholds, sparse_ffns

            model = self.engine.model
            mlps = sparse_ffns(model, self.sparsity)
            if mlps != self._sparse_ffns:  # SparseMLPs swapped in: compiled graphs must see them
                self._sparse_ffns = mlps
                self.engine.runner.set_plan(self.engine.runner.plan)
            per_level = {lv: ffn_thresholds(model, self.sparsity, *lv) for lv in set(levels)}
            settings.sparse_ffns = mlps
            settings.ffn_thresholds = torch.stack([per_level[lv] for lv in levels])
        from zcode.sparsity.apply import expert_limits

        counts = [expert_limits(plan)[0] for plan in plans]
        if len(set(counts)) > 1:
            from zcode.layers.moe import moe_layers

            settings.moes = moe_layers(self.engine.model)
            top_k = max(moe.gate.top_k for moe in settings.moes)
            settings.experts_per_token = torch.tensor([c or top_k for c in counts])
        if settings.ffn_thresholds is None and settings.experts_per_token is None:
            return None
        return settings

    def check(self, plan: ExecutionPlan) -> None:
        """Raises ValidationError unless this model can run `plan`'s precision, FFN level and
        expert limits."""
        self._precision_modules(plan.precision)
        self._check_experts(plan)
        if _names_ffn_level(plan) and self.sparsity is None:
            raise ValidationError("the plan names an FFN level: load a sparsity artifact")
        ffn_state = _ffn_level(plan) != (0.0, 0.0) or FFN_WEIGHTS in dict(plan.extras)
        if ffn_state and quantizes_ffn(plan.precision):
            raise ValidationError(
                "the plan quantizes FFN linears and names a sparse FFN level or rows: the sparse "
                "FFN reads its own rows (fp32 or int8), so a plan has one or the other"
            )

    def apply(self, plan: ExecutionPlan) -> None:
        """Moves the model to `plan`'s precision and FFN level, then declares it to the runner
        (without its skips: those are per request)."""
        modules = self._precision_modules(plan.precision)
        if modules is not None:
            from zcode.quant.variants import swap

            swap(self.engine.model, modules)
        self._set_ffn_level(plan)
        from zcode.layers.moe import set_experts_per_token
        from zcode.sparsity.apply import expert_limits

        set_experts_per_token(self.engine.model, *expert_limits(plan))
        self.engine.runner.set_plan(plan.without_skips())

    def _check_experts(self, plan: ExecutionPlan) -> None:
        extras = dict(plan.extras)
        if EXPERTS not in extras and EXPERT_MASS not in extras:
            return
        from zcode.layers.moe import moe_layers

        if not moe_layers(self.engine.model):
            raise ValidationError("the plan limits routed experts: this model has no MoE layers")
        try:
            count = int(extras.get(EXPERTS, 1))
            mass = float(extras.get(EXPERT_MASS, 1.0))
        except ValueError:
            raise ValidationError(f"the plan's expert limits are not numbers: {extras}") from None
        if count < 1 or not 0.0 < mass <= 1.0:
            raise ValidationError(
                f"the plan's {EXPERTS} must be >= 1 and its {EXPERT_MASS} in (0, 1]: {extras}"
            )

    def _precision_modules(self, precision: tuple[tuple[str, str], ...]) -> dict | None:
        """The variant modules of `precision` (None: the model has no variants, and the plan
        keeps the loaded weights)."""
        if self.variants is None:
            if precision != self.default.precision:
                raise ValidationError(
                    "the plan names precision formats this model has no variants of"
                )
            return None
        level = next(
            (lv for lv in self.variants.levels.values() if lv.plan.precision == precision), None
        )
        if level is None:
            raise ValidationError("the plan's precision is none of the model's precision variants")
        return level.modules

    def _set_ffn_level(self, plan: ExecutionPlan) -> None:
        if not _names_ffn_level(plan):
            return  # the FFNs as loaded
        if self.sparsity is None:
            raise ValidationError("the plan names an FFN level: load a sparsity artifact")
        from zcode.sparsity.apply import set_ffn_level

        weights = dict(plan.extras).get(FFN_WEIGHTS, "fp32")
        set_ffn_level(self.engine.model, self.sparsity, *_ffn_level(plan), weights)


def _names_ffn_level(plan: ExecutionPlan) -> bool:
    return any(name in (*FFN_LEVEL, FFN_WEIGHTS) for name, _ in plan.extras)


def _ffn_level(plan: ExecutionPlan) -> tuple[float, float]:
    """(sparsity_in, sparsity_mid) of the plan's FFNs; (0, 0) is dense."""
    extras = dict(plan.extras)
    return tuple(float(extras.get(name, 0.0)) for name in FFN_LEVEL)

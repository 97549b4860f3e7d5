"""The executor: the one code that moves the model to a plan (precision variant modules, FFN
level and the rows the sparse FFNs read) and declares that plan to the model runner, so compiled
decode keys its graphs by the plan's signature and re-reads the model's tensors at every change.
The engine calls it: each request carries its plan (`Sequence.plan`), and a step runs its rows
grouped by what must be model state, their precision and FFN rows (`group_key`), one forward per
group, moving the model to each group's plan first. Within a group FFN levels are per token
(`token_levels`: each SparseMLP takes a threshold per token), and skipped layers and KV heads per
row (LLMEngine.add_request).
"""

import dataclasses

import torch

from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan
from zcode.harness.planner import quantizes_ffn

FFN_LEVEL = ("ffn_sparsity_in", "ffn_sparsity_mid")  # the plan extras that name its FFN level
FFN_WEIGHTS = "ffn_weights"  # the plan extra naming the rows sparse FFNs read (absent: as loaded)


class PlanExecutor:
    def __init__(self, engine, variants=None, sparsity=None, default: ExecutionPlan | None = None):
        """`variants`: zcode.quant.variants.PrecisionVariants; `sparsity`: a SparsityArtifact;
        `default`: the plan of requests that name none (its KV is the prefix cache's unsalted
        KV)."""
        self.engine, self.variants, self.sparsity = engine, variants, sparsity
        self.default = default or engine.runner.plan
        self._sparse_ffns: list | None = None  # the modules token_levels last bound

    def group_key(self, plan: ExecutionPlan) -> str:
        """Rows whose plans share this key run in one forward: the plan less what is per row
        (skips; the FFN level, when an artifact gives levels; the rows the FFNs read stay:
        they are model state)."""
        plan = plan.without_skips()
        if self.sparsity is not None:
            extras = tuple((k, v) for k, v in plan.extras if k not in FFN_LEVEL)
            plan = dataclasses.replace(plan, extras=extras, ffn_density=1.0)
        return plan.signature()

    def token_levels(self, plans: list[ExecutionPlan]):
        """For one forward of requests with these plans (one group_key): None when they share
        one FFN level (the model's, once the group's plan is applied), else (each layer's
        SparseMLP or None, [B, L, 2] thresholds of each request) for
        zcode.sparsity.sparse_mlp.tokens_at_levels."""
        levels = [_ffn_level(plan) for plan in plans]
        if len(set(levels)) == 1:
            return None
        from zcode.sparsity.apply import ffn_thresholds, sparse_ffns

        model = self.engine.model
        mlps = sparse_ffns(model, self.sparsity)
        if mlps != self._sparse_ffns:  # SparseMLPs swapped in: compiled graphs must see them
            self._sparse_ffns = mlps
            self.engine.runner.set_plan(self.engine.runner.plan)
        per_level = {lv: ffn_thresholds(model, self.sparsity, *lv) for lv in set(levels)}
        return mlps, torch.stack([per_level[lv] for lv in levels])

    def check(self, plan: ExecutionPlan) -> None:
        """Raises ValidationError unless this model can run `plan`'s precision and FFN level."""
        self._precision_modules(plan.precision)
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
        self.engine.runner.set_plan(plan.without_skips())

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

"""The executor: the one code that moves the model to a plan (precision variant modules, FFN
level) and declares that plan to the model runner, so compiled decode keys its graphs by the
plan's signature and re-reads the model's tensors at every change. The engine calls it: each
request carries its plan (`Sequence.plan`), and a step runs its rows grouped by plan, one forward
per group, moving the model to each group's plan first. Skipped layers and KV heads stay per row
(LLMEngine.add_request), not model state.
"""

from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan


class PlanExecutor:
    def __init__(self, engine, variants=None, sparsity=None, default: ExecutionPlan | None = None):
        """`variants`: zcode.quant.variants.PrecisionVariants; `sparsity`: a SparsityArtifact;
        `default`: the plan of requests that name none (its KV is the prefix cache's unsalted
        KV)."""
        self.engine, self.variants, self.sparsity = engine, variants, sparsity
        self.default = default or engine.runner.plan

    def check(self, plan: ExecutionPlan) -> None:
        """Raises ValidationError unless this model can run `plan`'s precision and FFN level."""
        self._precision_modules(plan.precision)
        if "ffn_sparsity_in" in dict(plan.extras) and self.sparsity is None:
            raise ValidationError("the plan names an FFN level: load a sparsity artifact")

    def apply(self, plan: ExecutionPlan) -> None:
        """Moves the model to `plan`'s precision and FFN level, then declares it to the runner
        (without its skips: those are per request)."""
        modules = self._precision_modules(plan.precision)
        if modules is not None:
            from zcode.quant.variants import swap

            swap(self.engine.model, modules)
        self._set_ffn_level(dict(plan.extras))
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

    def _set_ffn_level(self, extras: dict[str, str]) -> None:
        if "ffn_sparsity_in" not in extras:
            return  # the FFNs as loaded
        if self.sparsity is None:
            raise ValidationError("the plan names an FFN level: load a sparsity artifact")
        from zcode.sparsity.apply import set_ffn_level

        set_ffn_level(
            self.engine.model,
            self.sparsity,
            float(extras["ffn_sparsity_in"]),
            float(extras["ffn_sparsity_mid"]),
        )

"""The executor: the one code that moves the model to a plan (precision variant modules, FFN
level) and declares that plan to the model runner, so compiled decode keys its graphs by the
plan's signature and re-reads the model's tensors at every change. Skipped layers and KV heads
are per request (LLMEngine.add_request), not model state.

Phase 1 of issue 17: a plan is model state, so it applies to every request running under it
(one generate call's batch); `running` refuses to change it under running requests. Per-row
plans in one batch are phase 2.
"""

from collections.abc import Iterator
from contextlib import contextmanager

from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan


class PlanExecutor:
    def __init__(self, engine, variants=None, sparsity=None, default: ExecutionPlan | None = None):
        """`variants`: zcode.quant.variants.PrecisionVariants; `sparsity`: a SparsityArtifact;
        `default`: the plan the model runs as loaded (its KV is the prefix cache's unsalted
        KV)."""
        self.engine, self.variants, self.sparsity = engine, variants, sparsity
        self.default = default or engine.runner.plan

    def apply(self, plan: ExecutionPlan) -> None:
        """Moves the model to `plan`'s precision and FFN level, then declares it to the runner
        (without its skips: those are per request)."""
        self._set_precision(plan.precision)
        self._set_ffn_level(dict(plan.extras))
        self.engine.runner.set_plan(plan.without_skips())

    @contextmanager
    def running(self, plan: ExecutionPlan) -> Iterator[None]:
        """`plan` applied for the requests added inside; the previous plan back on exit. KV
        computed under a plan other than the default is salted by its kv_signature."""
        engine = self.engine
        previous, salt = engine.runner.plan, engine.kv_salt
        if plan.kv_signature() != previous.kv_signature() and engine.has_unfinished():
            raise ValidationError(
                "a plan applies to every running request (per-row plans in one batch are not "
                "built yet: issue 17 phase 2): finish or abort the running requests first"
            )
        self.apply(plan)
        if plan.kv_signature() != self.default.kv_signature():
            engine.kv_salt = f"plan {plan.kv_signature()}"
        try:
            yield
        finally:
            engine.kv_salt = salt
            self.apply(previous)

    def _set_precision(self, precision: tuple[tuple[str, str], ...]) -> None:
        if self.variants is None:
            if precision != self.default.precision:
                raise ValidationError(
                    "the plan names precision formats this model has no variants of"
                )
            return
        level = next(
            (lv for lv in self.variants.levels.values() if lv.plan.precision == precision), None
        )
        if level is None:
            raise ValidationError("the plan's precision is none of the model's precision variants")
        from zcode.quant.variants import swap

        swap(self.engine.model, level.modules)

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

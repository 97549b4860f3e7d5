"""Per-request plans in the server: a request's hints pick its plan at admission (the same
planner as `generate`), and each engine step runs, of the unfinished requests' plans, the one of
least predicted quality loss (a request without hints counts at the default plan); skipped KV
heads and layers stay per request. So no request runs a plan sparser than its own; one batched
with a denser request runs slower than predicted, and its report lists every plan its steps ran.

The engine thread owns the mutable state: `admit`, `before_step`, `after_step` and `forget` are
called from it only; `plan` (from the HTTP side) reads the planner's candidates, computed at
start-up for requests without explicit skips.
"""

import math
import time
from dataclasses import dataclass, field

from zcode.engine.request_output import RequestOutput
from zcode.harness.executor import PlanExecutor
from zcode.harness.planner import Hints, PlanChoice, Planner
from zcode.harness.report import PlanReport, plan_report


@dataclass(frozen=True)
class Planned:
    """A server request's plan: the planner's choice for its hints."""

    choice: PlanChoice
    hints: Hints

    def skips(self) -> dict:
        """The layers and KV heads the request skips, as AsyncEngine.requests takes them."""
        plan = self.choice.plan
        return {"skip_layers": plan.skip_layers, "skip_kv_heads": plan.skip_kv_heads}


@dataclass
class _Running:
    choice: PlanChoice
    hints: Hints
    step_ms: list[float] = field(default_factory=list)  # decode steps: it already had a token
    plans_run: set[str] = field(default_factory=set)
    num_tokens: int = 0


class RequestPlans:
    def __init__(self, planner: Planner, executor: PlanExecutor) -> None:
        self.planner, self.executor = planner, executor
        self.default = planner.choose(Hints())
        planner.candidates()  # computed now, not on the HTTP side
        self.current = self.default.plan
        self._running: dict[str, _Running] = {}
        self._step_start = 0.0

    @classmethod
    def for_llm(cls, llm) -> "RequestPlans":
        return cls(llm.planner(), llm.executor())

    def plan(self, hints: Hints) -> Planned:
        return Planned(self.planner.choose(hints), hints)

    def kv_salt(self, planned: Planned) -> str | None:
        """The prefix-cache salt of KV computed under the request's plan (None: the default's):
        a step runs the request's plan or a denser one, so KV cached under it is at least as
        good as its own."""
        signature = planned.choice.plan.kv_signature()
        return None if signature == self.default.plan.kv_signature() else f"plan {signature}"

    def admit(self, request_id: str, planned: Planned) -> None:
        self._running[request_id] = _Running(planned.choice, planned.hints)

    def forget(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def before_step(self, request_ids: list[str]) -> None:
        """Moves the model to the least-loss plan among these unfinished requests'."""
        choices = [
            self._running[r].choice if r in self._running else self.default for r in request_ids
        ]
        if choices:
            plan = min(choices, key=_step_order).plan.without_skips()
            if plan != self.current:
                self.executor.apply(plan)
                self.current = plan
        self._step_start = time.perf_counter()

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Times the step for the planned requests in it; a finished one gets its report in
        `out.plan`."""
        step_ms = 1e3 * (time.perf_counter() - self._step_start)
        for out in outputs:
            running = self._running.get(out.request_id)
            if running is None:
                continue
            running.plans_run.add(self.current.name)
            if running.num_tokens and out.delta_token_ids:
                running.step_ms.append(step_ms)
            running.num_tokens = len(out.token_ids)
            if out.finished:
                del self._running[out.request_id]
                out.plan = _report(running)


def _step_order(choice: PlanChoice) -> tuple[float, float]:
    loss = choice.predicted_quality_loss_pct
    return (math.inf if loss is None else loss, -choice.plan.ffn_density)


def _report(running: _Running) -> PlanReport:
    return plan_report(
        running.choice, running.hints, running.step_ms, tuple(sorted(running.plans_run))
    )

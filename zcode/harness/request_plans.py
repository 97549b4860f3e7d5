"""Per-request plans in the server: a request's hints pick its plan at admission (the same
planner as `generate`), the engine runs it as the request's own (`Sequence.plan`: each step's
rows grouped by plan), and each finished request gets its report with the wall ms of the steps
it decoded in.

The engine thread owns the mutable state: `admit`, `after_step` and `forget` are called from it
only; `plan` (from the HTTP side) reads the planner's candidates, computed at start-up for
requests without explicit skips.
"""

from dataclasses import dataclass, field

from zcode.engine.request_output import RequestOutput
from zcode.harness.planner import Hints, PlanChoice, Planner
from zcode.harness.report import DecodeSteps, LatencyFeedback, plan_report


@dataclass(frozen=True)
class Planned:
    """A server request's plan: the planner's choice for its hints."""

    choice: PlanChoice
    hints: Hints

    def engine_args(self) -> dict:
        """The plan as LLMEngine.add_request takes it."""
        plan = self.choice.plan
        return {"skip_layers": plan.skip_layers, "skip_kv_heads": plan.skip_kv_heads, "plan": plan}


@dataclass
class _Running:
    planned: Planned
    steps: DecodeSteps = field(default_factory=DecodeSteps)
    num_tokens: int = 0


class RequestPlans:
    def __init__(self, planner: Planner, feedback: LatencyFeedback | None = None) -> None:
        """`feedback`: the LLM's latency feedback (None: plans by the cost model alone)."""
        self.planner = planner
        self.feedback = feedback
        planner.candidates()  # computed now, not on the HTTP side
        self._running: dict[str, _Running] = {}

    @classmethod
    def for_llm(cls, llm) -> "RequestPlans":
        return cls(llm.planner(), llm.latency_feedback)

    def plan(self, hints: Hints) -> Planned:
        scale = self.feedback.scale() if self.feedback is not None else 1.0
        return Planned(self.planner.choose(hints, latency_scale=scale), hints)

    def admit(self, request_id: str, planned: Planned) -> None:
        self._running[request_id] = _Running(planned)

    def forget(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def after_step(self, outputs: list[RequestOutput], step_ms: float) -> None:
        """Counts the step (`step_ms` of wall time) for the planned requests in it; a finished
        one gets its report in `out.plan`."""
        for out in outputs:
            running = self._running.get(out.request_id)
            if running is None:
                continue
            if running.num_tokens and out.delta_token_ids:  # a decode step: it had a token
                running.steps.add(step_ms, len(out.token_ids) - running.num_tokens)
            running.num_tokens = len(out.token_ids)
            if out.finished:
                del self._running[out.request_id]
                planned = running.planned
                out.plan = plan_report(planned.choice, planned.hints, running.steps)
                if self.feedback is not None:
                    self.feedback.record(out.plan)

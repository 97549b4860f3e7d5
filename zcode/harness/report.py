"""PlanReport: what a request's plan was and how it did, in each RequestOutput.plan (and as
JSON in the server's `zcode_plan`)."""

import statistics
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PlanReport:
    plan: str  # the plan's name
    signature: str  # ExecutionPlan.signature(): the work it runs
    predicted_ms_per_token: float | None = None  # the cost model's decode ms per step
    measured_ms_per_token: float | None = None  # median wall ms of this request's decode steps
    predicted_quality_loss_pct: float | None = None  # predicted perplexity increase, %
    kv_bytes_per_token: int | None = None
    binding: str = "none"  # "latency", "quality", "memory", "override" or "none"
    target_met: bool = True  # the predictions meet every target given
    targets: dict = field(default_factory=dict)  # the hints given: {"max_latency_ms": 20.0, ...}
    # Speculative decoding: drafted and accepted tokens, acceptance rate, mean accepted length.
    speculative: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def plan_report(choice, hints, step_ms: list[float]) -> PlanReport:
    """The report of a planner's PlanChoice for these Hints, with the decode steps' wall ms."""
    targets = {
        "max_latency_ms": hints.max_latency_ms,
        "max_quality_loss": hints.quality_budget_pct,
        "max_kv_bytes": hints.max_kv_bytes,
    }
    return PlanReport(
        plan=choice.plan.name,
        signature=choice.plan.signature(),
        predicted_ms_per_token=choice.predicted_ms_per_token,
        measured_ms_per_token=statistics.median(step_ms) if step_ms else None,
        predicted_quality_loss_pct=choice.predicted_quality_loss_pct,
        kv_bytes_per_token=choice.kv_bytes_per_token,
        binding=choice.binding,
        target_met=choice.target_met,
        targets={k: v for k, v in targets.items() if v is not None},
    )

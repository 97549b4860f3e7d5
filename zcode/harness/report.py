"""PlanReport: what a request's plan was and how it did, in each RequestOutput.plan (and as
JSON in the server's `zcode_plan`)."""

import statistics
import threading
from collections import deque
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class PlanReport:
    plan: str  # the plan's name
    signature: str  # ExecutionPlan.signature(): the work it runs
    # the cost model's decode ms per output token, times latency_scale (LatencyFeedback)
    predicted_ms_per_token: float | None = None
    measured_ms_per_token: float | None = None  # of this request's decode steps (DecodeSteps)
    predicted_quality_loss_pct: float | None = None  # predicted perplexity increase, %
    kv_bytes_per_token: int | None = None
    binding: str = "none"  # "latency", "quality", "memory", "override" or "none"
    target_met: bool = True  # the predictions meet every target given
    targets: dict = field(default_factory=dict)  # the hints given: {"max_latency_ms": 20.0, ...}
    # Speculative decoding: drafted and accepted tokens, acceptance rate, mean accepted length.
    speculative: dict | None = None
    # What the planner predicted of it: acceptance, drafts per step, gain over no drafts.
    predicted_speculation: dict | None = None
    latency_scale: float = 1.0  # measured over predicted ms of the latest requests, planned with
    # A routed request's moves to other plans as it decoded (zcode.harness.revision): each
    # {"at_token", "from", "to", "predicted_quality_loss_pct"}; the fields above are the last
    # plan's.
    revisions: tuple = ()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class DecodeSteps:
    """A request's decode steps (after its first token): their wall ms and the tokens they
    gave it (more than one a step where drafts were accepted)."""

    ms: list[float] = field(default_factory=list)
    num_tokens: int = 0

    def add(self, ms: float, num_tokens: int) -> None:
        self.ms.append(ms)
        self.num_tokens += num_tokens

    def ms_per_token(self) -> float | None:
        """The median step's ms over the mean tokens per step (robust to a slow step)."""
        if not self.ms:
            return None
        return statistics.median(self.ms) * len(self.ms) / self.num_tokens


def plan_report(choice, hints, steps: DecodeSteps) -> PlanReport:
    """The report of a planner's PlanChoice for these Hints, with its decode steps."""
    targets = {
        "max_latency_ms": hints.max_latency_ms,
        "max_quality_loss": hints.quality_budget_pct,
        "max_kv_bytes": hints.max_kv_bytes,
    }
    return PlanReport(
        plan=choice.plan.name,
        signature=choice.plan.signature(),
        predicted_ms_per_token=choice.predicted_ms_per_token,
        measured_ms_per_token=steps.ms_per_token(),
        predicted_quality_loss_pct=choice.predicted_quality_loss_pct,
        kv_bytes_per_token=choice.kv_bytes_per_token,
        binding=choice.binding,
        target_met=choice.target_met,
        targets={k: v for k, v in targets.items() if v is not None},
        predicted_speculation=choice.speculation and asdict(choice.speculation),
        latency_scale=choice.latency_scale,
    )


class LatencyFeedback:
    """Measured over predicted decode ms per token of an engine's latest planned requests. The
    cost model is fitted once, at one moment of a host whose memory bandwidth moves with its
    other tenants (30-66 GB/s within an hour on this project's machine: the same plans measured
    5% and 23% over one fit's predictions), so the planner multiplies its predictions by the
    median of the last `window` ratios before it checks a latency target: 1.0 before any, within
    [MIN_SCALE, MAX_SCALE] (a run of wild measurements does not make every target unreachable)."""

    MIN_SCALE, MAX_SCALE = 0.5, 2.0

    def __init__(self, window: int = 16) -> None:
        self.ratios: deque[float] = deque(maxlen=window)
        # The server records from its engine thread and plans from its HTTP side.
        self._lock = threading.Lock()

    def record(self, report: PlanReport) -> None:
        """A finished request's report: its measured ms over the cost model's own prediction
        (the report's, divided by the scale it was planned with)."""
        predicted, measured = report.predicted_ms_per_token, report.measured_ms_per_token
        if predicted and measured:
            with self._lock:
                self.ratios.append(measured * report.latency_scale / predicted)

    def scale(self) -> float:
        with self._lock:
            ratios = list(self.ratios)
        if not ratios:
            return 1.0
        return min(self.MAX_SCALE, max(self.MIN_SCALE, statistics.median(ratios)))

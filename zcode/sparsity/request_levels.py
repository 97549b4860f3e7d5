"""Per-request FFN levels in the server: a request's `max_latency_ms` picks its level at admission
(the same planner as `generate(max_latency_ms=)`), and each engine step runs the least-loss level
among the unfinished requests' levels (a request without a target counts at the server's default
level). So no request runs sparser than its own plan; one batched with a denser request runs
slower than predicted, and its report lists every level its steps ran.

The engine thread owns the mutable state: `admit`, `before_step`, `after_step` and `forget` are
called from it only; `plan` (from the HTTP side) only reads the model's sizes.
"""

import statistics
import time
from dataclasses import dataclass, field

from torch import nn

from zcode.engine.request_output import RequestOutput
from zcode.errors import ValidationError
from zcode.sparsity.apply import DEFAULT_MAX_PPL_RATIO, set_ffn_level
from zcode.sparsity.artifact import FFNLevel, SparsityArtifact
from zcode.sparsity.planner import choose_level, level_name, predicted_ms


@dataclass(frozen=True)
class RequestPlan:
    level: FFNLevel
    max_latency_ms: float
    predicted_ms_per_step: float
    target_met: bool  # whether the prediction meets the target (else: the fastest level)


@dataclass
class _Running:
    plan: RequestPlan
    step_ms: list[float] = field(default_factory=list)  # decode steps: it already had a token
    levels_run: set[str] = field(default_factory=set)
    num_tokens: int = 0


class RequestLevels:
    def __init__(self, model: nn.Module, artifact: SparsityArtifact) -> None:
        if artifact.latency is None:
            raise ValidationError("this sparsity artifact has no latency fit: run zcode calibrate")
        self.model, self.artifact = model, artifact
        self.default = artifact.best_level(DEFAULT_MAX_PPL_RATIO)  # LLM(sparsity=)'s level
        self.current = self.default
        self._running: dict[str, _Running] = {}
        self._step_start = 0.0

    def plan(self, max_latency_ms: float) -> RequestPlan:
        level, met = choose_level(self.model, self.artifact, max_latency_ms)
        predicted = predicted_ms(self.model, self.artifact, level)
        return RequestPlan(level, max_latency_ms, predicted, met)

    def admit(self, request_id: str, plan: RequestPlan) -> None:
        self._running[request_id] = _Running(plan)

    def forget(self, request_id: str) -> None:
        self._running.pop(request_id, None)

    def before_step(self, request_ids: list[str]) -> None:
        """Moves the FFNs to the least-loss level among these unfinished requests'."""
        levels = [
            self._running[r].plan.level if r in self._running else self.default for r in request_ids
        ]
        level = min(levels, key=lambda lv: (lv.ppl_ratio, lv.flops_skipped), default=self.current)
        if level != self.current:
            set_ffn_level(self.model, self.artifact, level.sparsity_in, level.sparsity_mid)
            self.current = level
        self._step_start = time.perf_counter()

    def after_step(self, outputs: list[RequestOutput]) -> None:
        """Times the step for the planned requests in it; a finished one gets its report in
        `out.plan`."""
        step_ms = 1e3 * (time.perf_counter() - self._step_start)
        for out in outputs:
            running = self._running.get(out.request_id)
            if running is None:
                continue
            running.levels_run.add(level_name(self.current))
            if running.num_tokens and out.delta_token_ids:
                running.step_ms.append(step_ms)
            running.num_tokens = len(out.token_ids)
            if out.finished:
                del self._running[out.request_id]
                out.plan = _report(running)


def _report(running: _Running) -> dict:
    plan, ms = running.plan, running.step_ms
    return {
        "plan": level_name(plan.level),
        "ffn_flops_skipped": round(plan.level.flops_skipped, 4),
        "max_latency_ms": plan.max_latency_ms,
        "predicted_ms_per_step": round(plan.predicted_ms_per_step, 3),
        "measured_ms_per_step": round(statistics.median(ms), 3) if ms else None,
        "predicted_ppl_ratio": round(plan.level.ppl_ratio, 4),
        "target_met": plan.target_met,
        "levels_run": sorted(running.levels_run),
    }

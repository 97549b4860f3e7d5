"""Plan revision during decoding (issue 17, item 5): a routed request's plan is chosen from its
prompt (zcode.harness.router reads the prompt's mean input embedding and length); as it decodes,
what it writes is input too. Every `every` output tokens the router reads the prompt and the
output so far, the planner chooses again for the request's hints, and where its choice differs
the request moves to it (LLMEngine.revise: its tokens so far are computed again under the new
plan, its output kept, so what follows is what the new plan continues that text with). Each move
is in the request's report (PlanReport.revisions); its measured ms per token includes the
recompute.
"""

from dataclasses import dataclass, field

from zcode.engine.sequence import Sequence
from zcode.harness.planner import Hints, PlanChoice

REVISE_EVERY = 32  # output tokens between the router's readings


@dataclass
class _Routed:
    hints: Hints
    choice: PlanChoice
    seq: Sequence | None = None
    next_at: int = REVISE_EVERY
    revisions: list[dict] = field(default_factory=list)


class PlanReviser:
    def __init__(
        self,
        engine,
        planner,
        router,
        embeddings,
        batch_size: int,
        context_len: int,
        latency_scale: float = 1.0,
        every: int = REVISE_EVERY,
    ) -> None:
        """`router`, `embeddings`: what routed the requests' prompts; the rest as the planner
        chose their first plans with (Planner.choose)."""
        if every < 1:
            raise ValueError(f"every must be >= 1, got {every}")
        self.engine, self.planner = engine, planner
        self.router, self.embeddings = router, embeddings
        self.batch_size, self.context_len = batch_size, context_len
        self.latency_scale, self.every = latency_scale, every
        self._routed: dict[int, _Routed] = {}

    def add(self, index: int, hints: Hints, choice: PlanChoice) -> None:
        """Request `index` of a generate call was routed: its hints and the plan chosen."""
        self._routed[index] = _Routed(hints, choice, next_at=self.every)

    def bind(self, seqs: list[Sequence]) -> None:
        """The generate call's sequences, by index, once added to the engine."""
        for index, routed in self._routed.items():
            routed.seq = seqs[index]

    def after_step(self) -> None:
        """Reads every routed request that reached a checkpoint and moves it where the
        planner's choice for its text so far differs."""
        for routed in self._routed.values():
            seq = routed.seq
            if seq is None or seq.is_finished or seq.num_output_tokens < routed.next_at:
                continue
            routed.next_at = seq.num_output_tokens + self.every
            predicted = self.router.predict(self.embeddings, seq.token_ids)
            choice = self.planner.choose(
                routed.hints, self.batch_size, self.context_len, predicted, self.latency_scale
            )
            if choice.plan == routed.choice.plan:
                continue
            self.engine.revise(seq, choice.plan)
            routed.revisions.append(
                {
                    "at_token": seq.num_output_tokens,
                    "from": routed.choice.plan.name,
                    "to": choice.plan.name,
                    "predicted_quality_loss_pct": choice.predicted_quality_loss_pct,
                }
            )
            routed.choice = choice

    def choice(self, index: int) -> PlanChoice | None:
        """Request `index`'s plan choice now (None: not routed)."""
        routed = self._routed.get(index)
        return None if routed is None else routed.choice

    def revisions(self, index: int) -> tuple[dict, ...]:
        routed = self._routed.get(index)
        return () if routed is None else tuple(routed.revisions)

"""The interface every drafter implements, and the engine's choice of drafter by name."""

from abc import ABC, abstractmethod

from zcode.config import SPECULATIVE_METHODS
from zcode.engine.sequence import Sequence
from zcode.errors import ValidationError
from zcode.harness.plan import ExecutionPlan


class Drafter(ABC):
    """Proposes tokens to follow each sequence's tokens; the engine verifies them with the full
    model in the next forward, so a bad draft costs time, never output."""

    @abstractmethod
    def propose(self, seqs: list[Sequence], max_num_tokens: list[int]) -> list[list[int]]:
        """Per sequence, at most `max_num_tokens[i]` tokens to follow `seqs[i].token_ids`.

        Called after scheduling: each sequence's block table has room for its drafts, and its
        KV is computed up to (not including) its last token."""

    def cost_plan(self, num_layers: int) -> ExecutionPlan | None:
        """The plan whose decode step of the model costs what one draft step does (the draft
        policy's yardstick, zcode.spec.policy); None: drafting is free next to a forward."""
        return None


def make_drafter(runner, config) -> Drafter:
    """The drafter `config.speculative` names (zcode.config.EngineConfig); `runner`: the
    engine's ModelRunner (a self-draft runs its model on its KV cache). The MTP drafter is made
    by the engine itself, before the runner: its caches count in the KV budget
    (zcode.spec.mtp.MtpDrafter)."""
    name = config.speculative
    if config.draft_skip_layers is not None and name != "skip_layers":
        raise ValidationError("draft_skip_layers needs speculative='skip_layers'")
    if config.draft_format is not None and name != "quantized":
        raise ValidationError("draft_format needs speculative='quantized'")
    if name == "ngram":
        from zcode.spec.ngram import NgramDrafter

        return NgramDrafter()
    if name == "skip_layers":
        from zcode.spec.self_draft import SkipLayersDrafter

        return SkipLayersDrafter(runner, config.draft_skip_layers)
    if name == "quantized":
        from zcode.spec.self_draft import QuantizedDrafter

        return QuantizedDrafter(runner, config.draft_format or "int8")
    raise ValueError(f"speculative must be one of {SPECULATIVE_METHODS}, got {name!r}")

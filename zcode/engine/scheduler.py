"""Chooses which sequences run in the next step and how many of their tokens.

Requests are counted by computed vs total tokens, not by phase: a prompt is prefilled in chunks
that fit the step's token budget, a decoding sequence asks for one token, and both share a step.
Running sequences go first; when KV blocks run out the newest running sequence is preempted
(its blocks freed, to be recomputed later). A sequence admitted from the queue starts after the
longest prefix of its tokens already in the prefix cache. A decoding sequence that speculates
also gets room for up to `num_lookahead_tokens` drafted tokens in a step that prefills no
prompt, if the budget and the free blocks left after the step's known tokens allow, without
preempting anyone.
"""

from collections import deque
from dataclasses import dataclass

from zcode.engine.block_manager import BlockManager
from zcode.engine.sequence import Sequence, SequenceStatus
from zcode.errors import ValidationError


@dataclass(frozen=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # known tokens to compute
    num_lookahead_tokens: int = 0  # KV slots reserved after them for drafted tokens

    @property
    def completes_prompt(self) -> bool:
        """After this step every known token is cached, so the sequence samples its next token."""
        return self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens

    @property
    def is_decode(self) -> bool:
        """The row computes its last known token (its drafts may follow): no prompt chunk."""
        return self.num_new_tokens == 1 and self.completes_prompt


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        # A sequence that cannot fit alone in the whole cache would wait (or preempt) forever.
        max_tokens = seq.num_prompt_tokens + seq.params.max_tokens
        bm = self.block_manager
        max_blocks = bm.max_blocks(seq)
        if -(-max_tokens // bm.block_size) > max_blocks:
            raise ValidationError(
                f"{max_tokens} tokens ({seq.num_prompt_tokens} in the prompt, "
                f"{seq.params.max_tokens} to generate) do not fit in the KV cache of "
                f"{max_blocks * bm.block_size} tokens"
            )
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        for seq in self.running:  # what the previous step computed becomes reusable
            self.block_manager.cache_full_blocks(seq)
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:  # preempted below to make room for an older sequence
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self._make_room(seq, num_new):
                continue
            self.block_manager.allocate(seq, num_new)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            prefix = self.block_manager.cached_prefix(seq)
            num_new = min(seq.num_tokens - len(prefix) * self.block_manager.block_size, budget)
            if not self.block_manager.can_allocate(seq, num_new, prefix):
                break
            self.waiting.popleft()
            self.block_manager.allocate(seq, num_new, prefix)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
        return self._with_lookahead(scheduled, budget)

    def _with_lookahead(self, scheduled: list[ScheduledSeq], budget: int) -> list[ScheduledSeq]:
        """Draft slots from what budget and blocks the step's known tokens left, none in a step
        that prefills: prefill is never displaced by tokens that may be rejected, and the steps
        that mix prompt chunks with decode rows (whose kernels are then the prefill's) are those
        of plain decoding, so its outputs stay the same bits."""
        if not all(s.is_decode for s in scheduled):
            return scheduled
        for i, s in enumerate(scheduled):
            lookahead = self._lookahead(s.seq, budget)
            if lookahead:
                self.block_manager.allocate(s.seq, s.num_new_tokens + lookahead)
                scheduled[i] = ScheduledSeq(s.seq, s.num_new_tokens, lookahead)
                budget -= lookahead
        return scheduled

    def _lookahead(self, seq: Sequence, budget: int) -> int:
        """Draft slots for `seq` this step: none past its max_tokens (the token sampled after
        the last draft comes free), none that would need a preemption."""
        if not seq.num_lookahead_tokens or not seq.is_decoding:
            return 0
        num_left = seq.params.max_tokens - seq.num_output_tokens - 1
        lookahead = max(0, min(seq.num_lookahead_tokens, budget, num_left))
        if not self.block_manager.can_allocate(seq, 1 + lookahead):
            return 0
        return lookahead

    def _make_room(self, seq: Sequence, num_new: int) -> bool:
        """Preempts the newest running sequences until `seq` fits; False if `seq` itself went."""
        while not self.block_manager.can_allocate(seq, num_new):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: Sequence) -> None:
        self.requeue(seq)
        self.num_preemptions += 1

    def requeue(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks and puts it first in the queue: its tokens are
        computed again when it is admitted."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

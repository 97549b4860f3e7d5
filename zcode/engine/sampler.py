"""Picks the next token for each sequence from its logits, honouring per-request parameters,
and watches each sequence for the signs of a broken step (`AnomalyGuard`)."""

import math
from dataclasses import dataclass

import numpy as np
import torch

from zcode.engine.sequence import Sequence
from zcode.spec.rejection import rejection_sample


@dataclass(frozen=True)
class AnomalyGuard:
    """What counts as an anomaly (GLM-5's "scaling pain": garbled output, repetition loops and
    rare-character bursts from KV races), per sequence:

    - `nan_logits`: a NaN or +inf logit (a grammar's -inf is fine);
    - `repetition`: the last `repeat_window` output tokens repeat a block of at most
      `max_period` tokens (checked every `repeat_check_every` tokens);
    - `improbable_burst`: `burst_len` tokens in a row each had probability below `burst_prob`
      in the distribution they were drawn from (near-uniform logits, the mark of corrupted KV).
    """

    burst_len: int = 8
    burst_prob: float = 1e-4
    repeat_window: int = 256
    max_period: int = 64
    repeat_check_every: int = 16

    def checks_repetition_at(self, num_output_tokens: int) -> bool:
        n = num_output_tokens
        return n >= self.repeat_window + self.max_period and n % self.repeat_check_every == 0

    def is_repeating(self, output_token_ids: list[int]) -> bool:
        tail = np.asarray(output_token_ids[-(self.repeat_window + self.max_period) :])
        window = tail[self.max_period :]
        return any(
            np.array_equal(window, tail[self.max_period - p : len(tail) - p])
            for p in range(1, self.max_period + 1)
        )


_MARGIN = 10.0  # logits this far below the max add < exp(-10) = 4.5e-5 each to the softmax sum


class Sampler:
    def __init__(self, guard: AnomalyGuard | None = None) -> None:
        self._generators: dict[int, torch.Generator] = {}
        self.guard = guard or AnomalyGuard()
        self._num_improbable: dict[int, int] = {}  # seq_id -> improbable tokens in a row
        self._anomalies: dict[int, str] = {}  # seq_id -> the kind its last token showed

    def anomaly(self, seq: Sequence) -> str | None:
        """The anomaly the token just sampled for `seq` showed, if any (then `seq` should end)."""
        return self._anomalies.pop(seq.seq_id, None)

    def __call__(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        draft_token_ids: list[int | None] | None = None,
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [B, V] fp32 -> (token ids [B], per-sequence {token: logprob} or None).

        draft_token_ids: per row, a token a deterministic drafter proposed at this position (or
        None); a sampled row then keeps or replaces it by the rejection rule, so the returned
        token equals the draft exactly when it is accepted, for greedy rows as for sampled ones.
        """
        drafts = draft_token_ids or [None] * len(seqs)
        wants_logprobs = any(seq.params.logprobs is not None for seq in seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        logits = self._penalise(logits, seqs)
        # numpy, single-threaded and vectorised: its max (NaN if any, +inf if any) and argmax
        # (first maximum, like torch's) take ~3 us each for a 49152-token vocabulary where
        # torch's isnan | isposinf takes ~65 and its argmax ~75, more when the step's other
        # threads must wake up for them.
        row_max = logits.numpy().max(-1)  # [B]
        broken = np.isnan(row_max) | (row_max == np.inf)
        if broken.any():
            logits = logits.masked_fill(torch.from_numpy(broken)[:, None], 0.0)  # seq ends
            row_max = logits.numpy().max(-1)
        greedy = logits.numpy().argmax(-1)
        tokens = []
        for i, seq in enumerate(seqs):
            if seq.params.greedy:
                tokens.append(int(greedy[i]))
                improbable = self._argmax_improbable(logits[i].numpy(), float(row_max[i]))
            else:
                probs = self._filtered_probs(logits[i], seq)
                generator = self._generator(seq)
                if drafts[i] is None:
                    tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
                else:
                    tokens.append(rejection_sample(probs, drafts[i], generator=generator))
                improbable = float(probs[tokens[-1]]) < self.guard.burst_prob
            self._watch(seq, tokens[-1], improbable, bool(broken[i]))
        if raw_logprobs is None:
            return tokens, [None] * len(seqs)
        return tokens, [
            top_logprobs(raw_logprobs[i], tokens[i], seq.params.logprobs)
            for i, seq in enumerate(seqs)
        ]

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        if seq.seq_id not in self._generators:
            self._generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        return self._generators[seq.seq_id]

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq.seq_id, None)
        self._num_improbable.pop(seq.seq_id, None)
        self._anomalies.pop(seq.seq_id, None)

    def _argmax_improbable(self, row: np.ndarray, row_max: float) -> bool:
        """Whether the argmax of logits `row` has probability 1 / sum(exp(row - max)) below the
        guard's burst_prob. Most rows are settled by a count: a logit within _MARGIN of the max
        adds at most 1 to the sum, any other less than exp(-_MARGIN). Only where that bound does
        not decide is every logit exponentiated (Gemma 3's 262144, with the temporaries: ~0.9 ms
        a step)."""
        limit = 1.0 / self.guard.burst_prob
        near = int(np.count_nonzero(row > row_max - _MARGIN))
        if near + (row.size - near) * math.exp(-_MARGIN) < limit:
            return False
        return float(np.exp(row - row_max).sum(dtype=np.float64)) > limit

    def _watch(self, seq: Sequence, token: int, improbable: bool, broken: bool) -> None:
        guard = self.guard
        run = self._num_improbable.get(seq.seq_id, 0) + 1 if improbable else 0
        self._num_improbable[seq.seq_id] = run
        if broken:
            self._anomalies[seq.seq_id] = "nan_logits"
        elif run >= guard.burst_len:
            self._anomalies[seq.seq_id] = "improbable_burst"
        elif guard.checks_repetition_at(seq.num_output_tokens + 1) and guard.is_repeating(
            seq.output_token_ids + [token]
        ):
            self._anomalies[seq.seq_id] = "repetition"

    @staticmethod
    def _penalise(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """logit_bias, then repetition, frequency and presence penalties, in vLLM's order."""
        rows = [i for i, s in enumerate(seqs) if _penalises(s.params)]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            p, row = seqs[i].params, logits[i]
            if p.logit_bias:
                ids, biases = zip(*p.logit_bias)
                row[list(ids)] += torch.tensor(biases, dtype=row.dtype)
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(sorted(set(seqs[i].token_ids)), dtype=torch.int64)
                values = row[seen]
                penalty = p.repetition_penalty
                row[seen] = torch.where(values > 0, values / penalty, values * penalty)
            if (p.frequency_penalty or p.presence_penalty) and seqs[i].num_output_tokens:
                output = torch.tensor(seqs[i].output_token_ids, dtype=torch.int64)
                counts = torch.bincount(output, minlength=row.shape[-1])[: row.shape[-1]]
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        return logits

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
        # logits: [V] -> probabilities after temperature, top-k, top-p and min-p
        p = seq.params
        logits = logits / p.temperature
        if 0 < p.top_k < logits.shape[-1]:
            kth = logits.topk(p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            before = sorted_probs.cumsum(-1) - sorted_probs  # mass strictly above each token
            sorted_probs = sorted_probs.masked_fill(before >= p.top_p, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs / probs.sum()


def _penalises(p) -> bool:
    return bool(
        p.logit_bias or p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
    )


def top_logprobs(
    logprobs: torch.Tensor, token: int, num_top: int | None
) -> dict[int, float] | None:
    """{token: logprob} for the chosen token and the num_top most likely ones (None if off)."""
    if num_top is None:
        return None
    out = {token: float(logprobs[token])}
    if num_top > 0:
        values, ids = logprobs.topk(num_top)
        out.update(zip(ids.tolist(), values.tolist()))
    return out

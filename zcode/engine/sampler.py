"""Picks the next token for each sequence from its logits, honouring per-request parameters."""

import torch

from zcode.engine.sequence import Sequence


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[int, torch.Generator] = {}

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: [B, V] fp32 -> (token ids [B], per-sequence {token: logprob} or None)."""
        wants_logprobs = any(seq.params.logprobs is not None for seq in seqs)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if wants_logprobs else None
        logits = self._penalise(logits, seqs)
        # numpy's argmax (first maximum, like torch's) is vectorised: ~3 us for a 49152-token
        # vocabulary where torch's max takes ~27 us and its argmax ~75.
        greedy = logits.numpy().argmax(-1)
        tokens = []
        for i, seq in enumerate(seqs):
            if seq.params.greedy:
                tokens.append(int(greedy[i]))
            else:
                probs = self._filtered_probs(logits[i], seq)
                generator = self._generator(seq)
                tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
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

"""Op `sample_probs`: per-row sampling distributions after temperature, top-k, top-p, min-p.

Reference: the engine sampler's own filter, zcode.engine.sampler.Sampler._filtered_probs, one
row at a time. CPU variant: `batched` filters all rows at once (one sort for the batch).
"""

from types import SimpleNamespace

import torch

from zcode.engine.sampler import Sampler
from zcode.kernels.registry import define_op, register


def reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """logits: [B, V] fp32; the parameters [B] each (top_k 0 = off) -> probabilities [B, V]."""
    rows = []
    for i in range(logits.shape[0]):
        params = SimpleNamespace(
            temperature=float(temperature[i]),
            top_k=int(top_k[i]),
            top_p=float(top_p[i]),
            min_p=float(min_p[i]),
        )
        rows.append(Sampler._filtered_probs(logits[i], SimpleNamespace(params=params)))
    return torch.stack(rows)


def shape_class(logits: torch.Tensor, *args) -> str:
    rows = "1" if logits.shape[0] == 1 else "<=16" if logits.shape[0] <= 16 else "many"
    return f"V{logits.shape[1]}|rows{rows}"


def cases() -> list:
    def case(rows: int, vocab: int):
        def make(generator: torch.Generator):
            logits = torch.randn(rows, vocab, generator=generator) * 3
            temperature = torch.rand(rows, generator=generator) + 0.3
            top_k = torch.randint(0, vocab + 3, (rows,), generator=generator)
            top_p = torch.where(
                torch.rand(rows, generator=generator) < 0.3,
                1.0,
                torch.rand(rows, generator=generator),
            )
            min_p = torch.where(
                torch.rand(rows, generator=generator) < 0.5,
                0.0,
                torch.rand(rows, generator=generator) * 0.2,
            )
            return logits, temperature, top_k, top_p, min_p

        return f"B{rows}-V{vocab}", make

    return [case(1, 50), case(6, 1000), case(3, 7)]


define_op("sample_probs", reference, shape_class, cases, lambda *args: (1e-5, 1e-7))


@register("sample_probs", "batched")
def batched(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    vocab = logits.shape[-1]
    logits = logits / temperature[:, None]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    # top-k: keep values >= the k-th largest (ties included, as the reference does)
    active = (top_k > 0) & (top_k < vocab)
    kth = sorted_logits.gather(1, (top_k.clamp(1, vocab) - 1)[:, None])  # [B, 1]
    drop_k = active[:, None] & (sorted_logits < kth)
    probs = torch.softmax(sorted_logits.masked_fill(drop_k, float("-inf")), dim=-1)
    before = probs.cumsum(-1) - probs  # mass strictly above each token
    probs = probs.masked_fill((top_p[:, None] < 1.0) & (before >= top_p[:, None]), 0.0)
    probs = probs.masked_fill(probs < min_p[:, None] * probs[:, :1], 0.0)
    probs = probs / probs.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter_(1, order, probs)

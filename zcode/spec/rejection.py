"""The acceptance rule of speculative sampling (Leviathan et al. 2023, Chen et al. 2023).

A token d drafted from q is kept with probability min(1, p(d) / q(d)); otherwise the token is
drawn from norm(max(p - q, 0)). The result is distributed exactly as p, whatever q is. For a
deterministic drafter q is one-hot at d: d is kept with probability p(d), else the token comes
from p with d removed. Greedy requests need no rule: a draft is kept when it is the argmax.
"""

import torch


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_id: int,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> int:
    """target_probs: [V] p, the distribution the request samples from; draft_probs: [V] q the
    draft was drawn from (None: one-hot at the draft). Returns the token: the draft if kept."""
    p_draft = float(target_probs[draft_token_id])
    q_draft = 1.0 if draft_probs is None else float(draft_probs[draft_token_id])
    uniform = float(torch.rand((), generator=generator, dtype=torch.float64))
    if q_draft > 0 and uniform < p_draft / q_draft:  # min(1, p/q) by the draw
        return draft_token_id
    if draft_probs is None:
        residual = target_probs.clone()
        residual[draft_token_id] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_(min=0.0)
    if float(residual.sum()) <= 0.0:  # p == q (up to rounding): p itself is the residual
        residual = target_probs
    return int(torch.multinomial(residual / residual.sum(), 1, generator=generator))

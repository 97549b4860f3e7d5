"""Perplexity of a token stream with a sliding window: the quality yardstick every adaptive
feature reports against.

Windows of `window` tokens advance by `stride`; each token is scored once, by the first window
that covers it as a target, with up to `window - stride` tokens of context before it (the
recipe of the HF perplexity guide, so numbers compare with transformers').
"""

import math
from dataclasses import dataclass

from zcode.llm import LLM
from zcode.sampling_params import SamplingParams


@dataclass(frozen=True)
class PerplexityResult:
    nll_sum: float  # natural-log loss summed over scored tokens
    num_tokens: int  # tokens scored (all but the first)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_tokens)


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored index) of each window."""
    if not 0 < stride <= window:
        raise ValueError(f"need 0 < stride <= window, got stride {stride}, window {window}")
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        if end - begin >= 2:
            out.append((begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def perplexity(
    llm: LLM, token_ids: list[int], window: int = 512, stride: int = 256, **skips
) -> PerplexityResult:
    """skips: what the scoring requests skip (LLM.generate's skip_layers / skip_kv_heads)."""
    if len(token_ids) < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    spans = windows(len(token_ids), window, stride)
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, ignore_eos=True)
    outputs = llm.generate([token_ids[b:e] for b, e, _ in spans], params, **skips)
    nll_sum, count = 0.0, 0
    for (begin, end, first), out in zip(spans, outputs):
        for position in range(first, end):
            entry = out.prompt_logprobs[position - begin]
            nll_sum -= entry[token_ids[position]]
            count += 1
    return PerplexityResult(nll_sum, count)

"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to fp32) against
transformers reading the same file: greedy generation token for token, and sliding-window
perplexity on text nobody here wrote (a Python standard-library source file).
"""

import inspect
import json.decoder
import math
import warnings

import torch

from zcode.ppl import perplexity
from zcode.sampling_params import SamplingParams

NUM_NEW_TOKENS = 64
ARGMAX_TIE_GAP = 1e-4  # greedy comparison stops at a step whose top-2 logits are this close
PPL_TOKENS = 1536
WINDOW, STRIDE = 512, 256
PPL_REL_TOL = 1e-3

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "Explain in one sentence what a KV cache is."}],
    [{"role": "user", "content": "List three prime numbers and say why they are prime."}],
]


def oracle_greedy(oracle, prompt: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation and the top-2 logit gap at each step."""
    with torch.no_grad():
        # eos_token_id=None (a generate() argument) turns off stopping, like ignore_eos. The
        # explicit mask matters: generate() would otherwise mask every prompt token equal to
        # pad_token_id, and SmolLM2's pad id is <|im_end|>, which chat prompts contain.
        out = oracle.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=NUM_NEW_TOKENS,
            eos_token_id=None,
            pad_token_id=oracle.generation_config.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    top2 = [step[0].topk(2).values for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), [(v[0] - v[1]).item() for v in top2]


def test_greedy_generation_matches_transformers(default_llm, default_oracle):
    prompts = [default_llm.encode(p) for p in TEXT_PROMPTS + CHAT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    outputs = default_llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        want, gaps = oracle_greedy(default_oracle, prompt)
        assert len(want) == len(out.token_ids) == NUM_NEW_TOKENS
        near_tie = [i for i, gap in enumerate(gaps) if gap < ARGMAX_TIE_GAP]
        num_compared = near_tie[0] if near_tie else NUM_NEW_TOKENS
        if near_tie:
            warnings.warn(
                f"top-2 logits within {ARGMAX_TIE_GAP} at step {num_compared}; "
                f"comparing the first {num_compared} tokens only",
                stacklevel=1,
            )
        assert out.token_ids[:num_compared] == want[:num_compared], default_llm.tokenizer.decode(
            prompt
        )


def oracle_perplexity(oracle, token_ids: list[int]) -> tuple[float, int]:
    """The HF perplexity guide's sliding window: labels -100 on tokens an earlier window scored.

    Returns (summed NLL, number of scored tokens).
    """
    nll_sum, num_scored, prev_end = 0.0, 0, 0
    for begin in range(0, len(token_ids), STRIDE):
        end = min(begin + WINDOW, len(token_ids))
        target_len = end - prev_end
        input_ids = torch.tensor([token_ids[begin:end]])
        labels = input_ids.clone()
        labels[:, :-target_len] = -100
        with torch.no_grad():
            loss = oracle(input_ids, labels=labels).loss  # mean over the shifted valid labels
        num_valid = (labels[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * num_valid
        num_scored += num_valid
        prev_end = end
        if end == len(token_ids):
            break
    return nll_sum, num_scored


def test_perplexity_matches_transformers(default_llm, default_oracle):
    text = open(inspect.getsourcefile(json.decoder), encoding="utf-8").read()
    token_ids = default_llm.tokenizer.encode(text)[:PPL_TOKENS]
    assert len(token_ids) == PPL_TOKENS

    ours = perplexity(default_llm, token_ids, window=WINDOW, stride=STRIDE)
    nll_sum, num_scored = oracle_perplexity(default_oracle, token_ids)
    theirs = math.exp(nll_sum / num_scored)
    rel = abs(ours.perplexity - theirs) / theirs
    print(f"perplexity: ours {ours.perplexity:.6f}, transformers {theirs:.6f} (rel {rel:.1e})")
    assert ours.num_tokens == num_scored == PPL_TOKENS - 1
    assert abs(ours.perplexity - theirs) <= PPL_REL_TOL * theirs

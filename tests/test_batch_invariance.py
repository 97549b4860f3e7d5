"""A sequence's logits do not depend on what else shares its step.

Model level: sequences of different lengths prefilled together, and a mixed step in which one
sequence decodes, one starts its prefill and one continues a chunked prefill, each compared with
the same sequence run alone in one prefill. Engine level: the same through the scheduler, with a
small token budget so that chunked prefills and decodes share steps.
"""

import pytest
import torch
from paged_runner import PagedRunner
from tiny_models import VOCAB, configs

from zcode.llm import LLM
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams

TOL = 1e-5
NAMES = list(configs())


def random_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def alone(net, token_ids: list[int]) -> torch.Tensor:
    """Logits of every token of one sequence prefilled on its own, [len, V]."""
    return PagedRunner(net).step({"seq": token_ids})["seq"]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


@pytest.mark.parametrize("name", NAMES)
def test_prefill_batch_matches_alone(name, tiny_checkpoint):
    net, _ = load_model(tiny_checkpoint(name).path)
    seqs = {f"len{n}": random_ids(n, seed=n) for n in (5, 17, 33)}
    want = {key: alone(net, ids) for key, ids in seqs.items()}
    got = PagedRunner(net).step(seqs)
    diffs = {key: max_diff(got[key], want[key]) for key in seqs}
    print(f"{name}: prefill batch max |diff| {max(diffs.values()):.2e}")
    assert all(d <= TOL for d in diffs.values()), diffs


@pytest.mark.parametrize("name", NAMES)
def test_mixed_step_matches_alone(name, tiny_checkpoint):
    """Step 1 prefills `decoding` and the first chunk of `chunked`; step 2 decodes one token of
    `decoding`, prefills `fresh` whole and finishes `chunked`."""
    net, _ = load_model(tiny_checkpoint(name).path)
    decoding, fresh, chunked = random_ids(21, 1), random_ids(17, 2), random_ids(30, 3)
    want = {
        "decoding": alone(net, decoding),
        "fresh": alone(net, fresh),
        "chunked": alone(net, chunked),
    }
    runner = PagedRunner(net)
    first = runner.step({"decoding": decoding[:20], "chunked": chunked[:12]})
    second = runner.step({"decoding": decoding[20:], "fresh": fresh, "chunked": chunked[12:]})
    diffs = {
        "decoding prefill": max_diff(first["decoding"], want["decoding"][:20]),
        "decoding decode": max_diff(second["decoding"], want["decoding"][20:]),
        "fresh prefill": max_diff(second["fresh"], want["fresh"]),
        "chunk 1": max_diff(first["chunked"], want["chunked"][:12]),
        "chunk 2": max_diff(second["chunked"], want["chunked"][12:]),
    }
    print(f"{name}: mixed step max |diff| {max(diffs.values()):.2e}")
    assert all(d <= TOL for d in diffs.values()), diffs


@pytest.mark.parametrize("name", ["llama", "glm4_moe", "glm_moe_dsa"])
def test_engine_batch_matches_alone(name, tiny_checkpoint):
    """Greedy tokens and the log-probabilities of prompt and output tokens, in a batch whose
    16-token budget forces chunked prefills to share steps with decodes."""
    llm = LLM(tiny_checkpoint(name).path, kv_cache_bytes=1 << 20, max_num_batched_tokens=16)
    prompts = [random_ids(n, seed=n) for n in (5, 17, 33)]
    params = SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True, logprobs=0, prompt_logprobs=0
    )
    batched = llm.generate(prompts, params)
    worst = 0.0
    for prompt, out in zip(prompts, batched, strict=True):
        ref = llm.generate([prompt], params)[0]
        assert out.token_ids == ref.token_ids
        pairs = list(zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True))
        pairs += list(zip(out.logprobs, ref.logprobs, strict=True))
        assert len(pairs) == len(prompt) - 1 + 8
        for got, want in pairs:
            assert got.keys() == want.keys()
            worst = max(worst, *(abs(got[t] - want[t]) for t in got))
    print(f"{name}: engine batch max |logprob diff| {worst:.2e}")
    assert worst <= TOL

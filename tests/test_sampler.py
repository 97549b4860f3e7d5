"""The sampler against hand-computed distributions: filters, temperature, seeds, penalties,
log-probabilities."""

import math

import pytest
import torch

from zcode.engine.sampler import AnomalyGuard, Sampler
from zcode.engine.sequence import Sequence
from zcode.sampling_params import SamplingParams

VOCAB = 32


def _seqs(n: int, token_ids=(0,), **params) -> list[Sequence]:
    return [Sequence(list(token_ids), SamplingParams(**params), None) for _ in range(n)]


def _logits(rows: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _draw(logits: torch.Tensor, n: int, **params) -> list[int]:
    """n independent samples from one row of logits (global RNG, seeded by the caller)."""
    tokens, _ = Sampler()(logits.expand(n, -1), _seqs(n, **params))
    return tokens


def test_greedy_is_argmax():
    logits = _logits(rows=8)
    tokens, logprobs = Sampler()(logits, _seqs(8, temperature=0))
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 8


def test_top_k_1_is_greedy():
    torch.manual_seed(0)
    logits = _logits(rows=8)
    tokens, _ = Sampler()(logits, _seqs(8, temperature=1.5, top_k=1))
    assert tokens == logits.argmax(dim=-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token():
    torch.manual_seed(0)
    logits = _logits()
    assert set(_draw(logits, 200, temperature=1.0, top_p=1e-6)) == {int(logits.argmax())}


def test_top_p_keeps_the_smallest_set_reaching_p():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    # Mass above token 2 is 0.8 < 0.85, so it stays; above token 3 is 0.95, so it goes.
    assert set(_draw(logits, 500, top_p=0.85)) == {0, 1, 2}


def test_top_k_keeps_the_k_most_likely():
    torch.manual_seed(0)
    logits = _logits()
    top3 = set(logits[0].topk(3).indices.tolist())
    assert set(_draw(logits, 500, temperature=5.0, top_k=3)) == top3


def test_min_p_filters_relative_to_the_top_probability():
    torch.manual_seed(0)
    probs = torch.tensor([[0.40, 0.25, 0.21, 0.14]])
    # min_p 0.5 keeps tokens with p >= 0.2 (half of the top 0.4)
    assert set(_draw(probs.log(), 1000, min_p=0.5)) == {0, 1, 2}


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature):
    torch.manual_seed(0)
    logits = torch.tensor([[1.0, 0.0, -1.0, 0.5]])
    n = 4000
    counts = torch.bincount(torch.tensor(_draw(logits, n, temperature=temperature)), minlength=4)
    expected = torch.softmax(logits[0] / temperature, dim=-1)
    # binomial standard error is at most 0.008 for n = 4000
    torch.testing.assert_close(counts / n, expected, rtol=0, atol=0.04)


def test_seed_makes_samples_reproducible():
    logits = torch.zeros(1, VOCAB)  # uniform: every draw is a fresh choice

    def run(seed: int) -> list[int]:
        sampler = Sampler()
        seq = _seqs(1, seed=seed)[0]
        return [sampler(logits, [seq])[0][0] for _ in range(20)]

    torch.manual_seed(123)
    first = run(7)
    torch.manual_seed(456)  # the global RNG must not matter
    assert run(7) == first
    assert run(8) != first


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 1.5, -0.5, 0.0]])
    seq = _seqs(1, token_ids=[0, 1, 0], repetition_penalty=2.0)
    penalised = Sampler._penalise(logits, seq)
    torch.testing.assert_close(penalised, torch.tensor([[1.0, -2.0, 1.5, -0.5, 0.0]]))
    assert logits[0, 0] == 2.0  # the caller's logits are untouched
    # greedy now prefers token 2 over the repeated token 0
    greedy = _seqs(1, token_ids=[0, 1], temperature=0, repetition_penalty=2.0)
    assert Sampler()(logits, greedy)[0] == [2]


@pytest.mark.parametrize("num_top", [0, 3])
def test_logprobs_are_log_softmax_of_the_raw_logits(num_top):
    torch.manual_seed(0)
    logits = _logits(rows=4, seed=1)
    seqs = _seqs(4, temperature=0.7, repetition_penalty=1.3, logprobs=num_top)
    tokens, logprobs = Sampler()(logits, seqs)
    expected = torch.log_softmax(logits.double(), dim=-1)
    for row, (token, entry) in enumerate(zip(tokens, logprobs, strict=True)):
        top = expected[row].topk(num_top).indices.tolist()
        assert set(entry) == {token, *top}
        for token_id, value in entry.items():
            assert value == pytest.approx(float(expected[row, token_id]), abs=1e-5)


def test_logit_bias_then_frequency_and_presence_penalties_as_openai_defines_them():
    # Prompt [3, 3]; output so far [0, 0, 1]: counts over the output only are {0: 2, 1: 1}.
    seq = Sequence([3, 3], SamplingParams(frequency_penalty=0.5, presence_penalty=0.25,
                                          logit_bias={2: 4.0, 4: -100.0}), None)  # fmt: skip
    seq.token_ids += [0, 0, 1]
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]])
    # OpenAI: mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence, after the bias.
    expected = torch.tensor([[1.0 - 2 * 0.5 - 0.25, 2.0 - 0.5 - 0.25, 3.0, 0.5, -97.0]])
    torch.testing.assert_close(Sampler._penalise(logits, [seq]), expected)
    tokens, _ = Sampler()(logits, [seq])  # sampled from the penalised logits
    assert tokens[0] in {0, 1, 2, 3}


def test_penalties_steer_greedy_decoding():
    seq = Sequence([0], SamplingParams(temperature=0, logit_bias={"3": 100}), None)
    assert Sampler()(torch.tensor([[5.0, 0.0, 0.0, 0.0]]), [seq])[0] == [3]
    seq = Sequence([0], SamplingParams(temperature=0, presence_penalty=2.0), None)
    seq.token_ids.append(0)  # 0 was generated: 5 - 2 < 4
    assert Sampler()(torch.tensor([[5.0, 4.0]]), [seq])[0] == [1]


@pytest.mark.parametrize(
    "params",
    [
        {"presence_penalty": 2.5},
        {"frequency_penalty": -3},
        {"logit_bias": {1: 101}},
        {"logit_bias": {-1: 1}},
        {"temperature": float("inf")},
        {"temperature": float("nan")},
        {"top_p": float("nan")},
    ],
)
def test_out_of_range_penalties_and_non_finite_values_are_refused(params):
    from zcode.errors import ValidationError

    with pytest.raises(ValidationError):
        SamplingParams(**params)


def _run(sampler: Sampler, seq: Sequence, logits: torch.Tensor, steps: int) -> list:
    """Samples `steps` tokens for seq (appending them as the engine does); the anomalies seen."""
    seen = []
    for _ in range(steps):
        [token], _ = sampler(logits[None], [seq])
        seq.token_ids.append(token)
        seen.append(sampler.anomaly(seq))
    return seen


def test_nan_logits_are_an_anomaly_of_that_row_only():
    sampler = Sampler()
    seqs = _seqs(2, temperature=1.0) + _seqs(1, temperature=0)
    logits = _logits(rows=3)
    logits[1, 5] = float("nan")
    logits[2, 7] = float("inf")
    logits[0, 3] = float("-inf")  # what a grammar does: fine
    tokens, _ = sampler(logits, seqs)  # no crash in multinomial
    assert [sampler.anomaly(s) for s in seqs] == [None, "nan_logits", "nan_logits"]
    assert all(0 <= t < VOCAB for t in tokens)


def test_a_burst_of_improbable_tokens_is_caught_within_its_length():
    guard = AnomalyGuard(burst_len=8, burst_prob=1e-4)
    uniform = torch.zeros(50_000)  # corrupted KV: every token 2e-5 likely
    seen = _run(Sampler(guard), _seqs(1, temperature=1.0, seed=0)[0], uniform, 8)
    assert seen == [None] * 7 + ["improbable_burst"]
    peaked = torch.full((50_000,), -20.0)
    peaked[:3] = 0.0  # healthy: a few likely tokens
    assert _run(Sampler(guard), _seqs(1, temperature=1.0, seed=0)[0], peaked, 40) == [None] * 40


@pytest.mark.parametrize("sum_of_exps,caught", [(9_000, False), (11_000, True)])
def test_greedy_tokens_count_as_improbable_by_their_exact_probability(sum_of_exps, caught):
    """A greedy row's argmax has probability 1 / sum(exp(logit - max)); the guard's limit 1e-4
    sits between these two rows (probabilities 1.1e-4 and 9.1e-5), each with every logit close
    to the max, so no bound settles them without the sum."""
    guard = AnomalyGuard(burst_len=8, burst_prob=1e-4)
    vocab = 50_000
    logits = torch.full((vocab,), math.log((sum_of_exps - 1) / (vocab - 1)))
    logits[7] = 0.0
    seen = _run(Sampler(guard), _seqs(1, temperature=0)[0], logits, 8)
    assert seen == [None] * 7 + (["improbable_burst"] if caught else [None])
    peaked = torch.full((vocab,), -20.0)
    peaked[:3] = 0.0  # settled by the count: 3 logits near the max
    assert _run(Sampler(guard), _seqs(1, temperature=0)[0], peaked, 40) == [None] * 40


def test_a_repetition_loop_is_caught_and_varied_text_is_not():
    guard = AnomalyGuard(repeat_window=32, max_period=8, repeat_check_every=4)
    seq = _seqs(1, token_ids=[0])[0]
    seq.token_ids += [1, 2, 3] * 20  # a period-3 loop, 60 tokens so far
    sampler = Sampler(guard)
    sampler._watch(seq, 1, False, False)  # the 61st token does not complete a check step
    assert sampler.anomaly(seq) is None
    seq.token_ids += [1, 2, 3]
    sampler._watch(seq, 1, False, False)  # 64 tokens: checked
    assert sampler.anomaly(seq) == "repetition"
    varied = _seqs(1, token_ids=[0])[0]
    varied.token_ids += [
        int(t) for t in torch.randint(0, 1000, (63,), generator=torch.Generator().manual_seed(0))
    ]  # noqa: E501
    sampler._watch(varied, 5, False, False)
    assert sampler.anomaly(varied) is None

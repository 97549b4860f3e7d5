"""Speculative decoding: drafts verified in the step's forward leave outputs exactly those of
plain decoding.

Greedy outputs with each drafter are compared token for token with transformers' greedy
generation (tiny checkpoints) and with plain decoding (the same engine without drafts, itself
tested against transformers in test_real_model.py), alone, in mixed batches with requests that
do not speculate, and with the prefix cache reusing KV written around rejected drafts. Sampled
outputs are checked for the target distribution by a chi-square test against probabilities
computed by transformers, a test a wrong acceptance rule is shown to fail.

Engines here draft every request's num_draft_tokens (draft_policy "fixed"): these tests need
drafts made and count them, which the adaptive policy (tests/test_draft_policy.py) would cut
wherever this machine's cost model says they do not pay.
"""

import dataclasses

import pytest
import torch
from scipy.stats import chi2
from tiny_models import VOCAB

from zcode.engine.llm_engine import LLMEngine
from zcode.engine.request_output import RequestOutput
from zcode.errors import ValidationError
from zcode.llm import LLM
from zcode.quant.linear import QuantizedLinear
from zcode.sampling_params import SamplingParams
from zcode.spec.drafter import Drafter
from zcode.spec.ngram import NgramDrafter
from zcode.spec.rejection import rejection_sample

BLOCK = 4  # small blocks: drafts and rollbacks cross block boundaries often
DRAFTERS = {
    "ngram": {},
    "skip_layers": {"draft_skip_layers": (1,)},
    "quantized": {"draft_format": "int4-g32"},  # the coarsest: more rejections to roll back
}
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
CHI2_ALPHA = 1e-3  # deterministic seeds: the statistic is fixed, so this is no flake rate


def random_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def prompts() -> list[list[int]]:
    """Random prompts, and one that repeats itself, where n-gram lookup drafts at once."""
    loop = random_ids(6, seed=99)
    return [random_ids(n, seed=n) for n in (5, 13, 21)] + [loop * 3]


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """All requests added at once and stepped to the end; finished outputs in request order."""
    seqs = [engine.add_request(ids, params) for ids, params in requests]
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return [finished[seq.request_id] for seq in seqs]


def oracle_greedy(oracle, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        out = oracle.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=num_tokens,
            eos_token_id=None,
            pad_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def assert_drafts_were_tested(engine: LLMEngine) -> None:
    """Drafts were both accepted and rejected, so both paths ran."""
    totals = engine.spec_totals
    assert 0 < totals["num_accepted_tokens"] < totals["num_draft_tokens"], totals


def assert_no_blocks_held(engine: LLMEngine) -> None:
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and sum(bm.ref_counts) == 0


# ---- the pieces alone ---------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    drafter = NgramDrafter(min_n=2, max_n=3)
    assert drafter.lookup([1, 2, 3, 9, 1, 2, 3, 7, 5, 2, 3], 2) == [7, 5]  # [2, 3]: latest match
    assert drafter.lookup([5, 1, 2, 3, 8, 6, 2, 3, 9, 1, 2, 3], 3) == [8, 6, 2]  # [1, 2, 3]
    assert drafter.lookup([1, 2, 3, 4, 1, 2], 5) == [3, 4, 1, 2]  # runs into the suffix itself
    assert drafter.lookup([1, 2, 3, 4, 5], 3) == []  # no bigram repeats
    assert drafter.lookup([7], 3) == []


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's statistic; cells expected below 5 are pooled into one."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum()[None]])
    expected = torch.cat([expected[~small], expected[small].sum()[None]])
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def critical(num_cells: int) -> float:
    return float(chi2.ppf(1 - CHI2_ALPHA, num_cells - 1))


def wrong_rule(target_probs, draft_token_id, draft_probs=None, generator=None) -> int:
    """Keeps the draft by min(1, p/q) but resamples from p instead of norm(max(p - q, 0))."""
    q = 1.0 if draft_probs is None else float(draft_probs[draft_token_id])
    if float(torch.rand((), generator=generator, dtype=torch.float64)) < target_probs[
        draft_token_id
    ] / max(q, 1e-12):
        return draft_token_id
    return int(torch.multinomial(target_probs, 1, generator=generator))


@pytest.mark.parametrize("one_hot", [True, False])
def test_rejection_rule_keeps_the_target_distribution(one_hot):
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(6, generator=g, dtype=torch.float64) * 1.5, -1)
    num_samples = 20000

    def counts(rule) -> torch.Tensor:
        out = torch.zeros(6, dtype=torch.float64)
        for _ in range(num_samples):
            if one_hot:
                draft, draft_probs = 1, None
            else:
                draft, draft_probs = int(torch.multinomial(q, 1, generator=g)), q
            out[rule(p, draft, draft_probs, generator=g)] += 1
        return out

    assert chi_square(counts(rejection_sample), p) < critical(6)
    assert chi_square(counts(wrong_rule), p) > critical(6)  # the test can fail


# ---- greedy: token for token ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "method"),
    [
        ("llama", "ngram"),
        ("llama", "skip_layers"),
        ("glm4_moe", "ngram"),
        ("glm4_moe", "skip_layers"),
        ("glm4_moe", "quantized"),
        ("glm_moe_dsa", "ngram"),
        ("glm_moe_dsa", "quantized"),
    ],
)
def test_greedy_outputs_are_those_of_transformers(name, method, tiny_checkpoint):
    checkpoint = tiny_checkpoint(name)
    llm = LLM(
        checkpoint.path,
        kv_cache_bytes=1 << 20,
        block_size=BLOCK,
        speculative=method,
        num_draft_tokens=3,
        draft_policy="fixed",
        **DRAFTERS[method],
    )
    outputs = llm.generate(prompts(), GREEDY)
    for prompt, out in zip(prompts(), outputs, strict=True):
        assert out.token_ids == oracle_greedy(checkpoint.oracle, prompt, GREEDY.max_tokens)
        assert out.plan.speculative["method"] == method
    assert outputs[-1].plan.speculative["num_drafts"] > 0  # the prompt that repeats itself
    assert_drafts_were_tested(llm.engine)
    assert_no_blocks_held(llm.engine)


@pytest.mark.parametrize(
    ("name", "method"),
    [
        # Each case compiles its own graphs (~20-60 s on 2 cores): the default suite keeps one;
        # n-gram drafts of 0-3 tokens per row and an MoE self-draft run in `make test-slow`.
        pytest.param("llama", "ngram", marks=pytest.mark.slow),
        ("llama", "quantized"),
        pytest.param("glm4_moe", "quantized", marks=pytest.mark.slow),
    ],
)
def test_compiled_drafts_and_verification_give_transformers_outputs(name, method, tiny_checkpoint):
    """With compile, drafts are verified by compiled steps of a fixed query width (rows with
    fewer drafts padded: n-gram drafts 0 to 3 tokens per row) and a self-draft runs compiled
    graphs of its own module tree (an MoE one gathers its own quantized experts); tokens as
    transformers', and the model itself never changes. Two rows at a time (four prompts): each
    batch bucket is graphs to compile, for the model and its draft."""
    checkpoint = tiny_checkpoint(name)
    llm = LLM(
        checkpoint.path,
        kv_cache_bytes=1 << 20,
        block_size=BLOCK,
        compile=True,
        max_num_seqs=2,
        speculative=method,
        num_draft_tokens=3,
        draft_policy="fixed",
        **DRAFTERS[method],
    )
    weights_before = {name: id(t) for name, t in llm.model.state_dict(keep_vars=True).items()}
    outputs = llm.generate(prompts(), GREEDY)
    for prompt, out in zip(prompts(), outputs, strict=True):
        assert out.token_ids == oracle_greedy(checkpoint.oracle, prompt, GREEDY.max_tokens)
    assert_drafts_were_tested(llm.engine)
    assert_no_blocks_held(llm.engine)
    widths = {width for _, _, width in llm.engine.runner.graphs.graphs}
    assert 4 in widths, widths  # verifying steps ran compiled
    # ... and were timed by their shape, as the draft steps by their bucket (the policy's prices)
    assert 4 in {width for _, _, width in llm.engine.step_times.runs_ms}
    drafter_graphs = getattr(llm.engine.drafter, "graphs", None)
    if method != "ngram":
        assert drafter_graphs.num_compiles > 0 and drafter_graphs.direct
        assert set(llm.engine.drafter.step_times.runs_ms) <= set(drafter_graphs.buckets)
        assert llm.engine.drafter.step_times.runs_ms
        # gc.freeze ran after the draft's graphs were built too (else every full collection
        # walks them: ~20% of a SmolLM2 step)
        compiles = llm.engine.runner.graphs.num_compiles + drafter_graphs.num_compiles
        assert llm.engine._frozen_at_compiles == compiles
    assert {
        name: id(t) for name, t in llm.model.state_dict(keep_vars=True).items()
    } == weights_before


def test_skip_layers_draft_of_an_identity_layer_is_always_accepted(tiny_checkpoint):
    """With layer 1 made an identity (zero output projections), the draft that skips it is the
    model itself: every draft is accepted unless the draft ran at the wrong positions or read
    the wrong KV. (Different query shapes round differently: a near-tie may flip one.)"""
    llm = LLM(
        tiny_checkpoint("llama").path,
        kv_cache_bytes=1 << 20,
        block_size=BLOCK,
        speculative="skip_layers",
        draft_skip_layers=(1,),
        draft_policy="fixed",
    )
    layer = llm.model.model.layers[1]
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    llm.generate(prompts(), GREEDY)
    totals = llm.engine.spec_totals
    assert totals["num_accepted_tokens"] >= 0.95 * totals["num_draft_tokens"] > 0, totals


def bf16_drafting(checkpoint) -> LLM:
    """The tiny model drafting with its own weights in bf16: nearly every draft is accepted."""
    return LLM(
        checkpoint.path,
        kv_cache_bytes=1 << 20,
        block_size=BLOCK,
        speculative="quantized",
        draft_format="bf16",
        draft_policy="fixed",
    )


def test_a_self_draft_reads_the_kv_its_model_reads(tiny_checkpoint):
    """Engines over one model take turns on the KV cache of the engine built last. A self-draft
    is a second module tree sharing the model's cache dicts, so after another engine is built
    it drafts from the same KV as its model (it kept the older engine's, without the prompt:
    bench_spec's fixed W4A8 draft fell to 0.4x plain beside an adaptive one)."""
    checkpoint = tiny_checkpoint("llama")
    llm = bf16_drafting(checkpoint)
    LLMEngine(llm.model, llm.tokenizer, dataclasses.replace(llm.config, speculative=None))
    outputs = llm.generate(prompts(), GREEDY)
    for prompt, out in zip(prompts(), outputs, strict=True):
        assert out.token_ids == oracle_greedy(checkpoint.oracle, prompt, GREEDY.max_tokens)
    totals = llm.engine.spec_totals
    assert totals["num_accepted_tokens"] >= 0.9 * totals["num_draft_tokens"] > 0, totals


def test_a_bf16_draft_is_nearly_always_accepted(tiny_checkpoint):
    """The model with bf16 weights drafts what the fp32 model would, so nearly every draft is
    accepted unless the draft ran at the wrong positions or read the wrong KV; the model is
    back in fp32 after each draft (the outputs are transformers')."""
    checkpoint = tiny_checkpoint("llama")
    llm = bf16_drafting(checkpoint)
    outputs = llm.generate(prompts(), GREEDY)
    for prompt, out in zip(prompts(), outputs, strict=True):
        assert out.token_ids == oracle_greedy(checkpoint.oracle, prompt, GREEDY.max_tokens)
    totals = llm.engine.spec_totals
    assert totals["num_accepted_tokens"] >= 0.9 * totals["num_draft_tokens"] > 0, totals
    assert not any(isinstance(m, QuantizedLinear) for m in llm.model.modules())
    with pytest.raises(ValidationError, match="draft_format must be one of"):
        LLM(checkpoint.path, kv_cache_bytes=1 << 20, speculative="quantized", draft_format="int3")
    with pytest.raises(ValidationError, match="draft_format needs"):
        LLM(checkpoint.path, kv_cache_bytes=1 << 20, speculative="ngram", draft_format="int8")


def test_skip_layers_draft_refuses_dsa(tiny_checkpoint):
    with pytest.raises(NotImplementedError, match="DSA"):
        LLM(tiny_checkpoint("glm_moe_dsa").path, kv_cache_bytes=1 << 20, speculative="skip_layers")


@pytest.mark.parametrize("name", ["llama", "glm_moe_dsa"])
def test_mixed_batch_and_prefix_cache_match_plain_decoding(name, tiny_checkpoint):
    """Speculating requests beside ones that do not, a token budget that splits prefills,
    stop conditions, then a second wave whose prompts extend the first wave's outputs, so it
    reuses cached blocks written during speculation: any KV of a rejected draft left in a
    published block would change its tokens."""
    path = tiny_checkpoint(name).path
    engine_args = dict(kv_cache_bytes=1 << 20, block_size=BLOCK, max_num_batched_tokens=16)
    spec = LLM(path, speculative="ngram", num_draft_tokens=4, draft_policy="fixed", **engine_args)
    spec = spec.engine
    plain = LLM(path, enable_prefix_caching=False, **engine_args).engine
    first = [
        (ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, num_draft_tokens=k))
        for ids, n, k in zip(prompts(), (20, 9, 24, 17), (None, 0, 2, None))
    ]
    stop = run(plain, first[:1])[0].token_ids[5]
    stopping = SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop])
    first.append((prompts()[0], stopping))
    want = run(plain, [(ids, dataclasses.replace(p, num_draft_tokens=None)) for ids, p in first])
    got = run(spec, first)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert got[-1].finish_reason == "stop" and got[-1].token_ids[-1] == stop
    assert got[1].plan is None  # num_draft_tokens=0: it never speculated
    second = [(o.prompt_token_ids + o.token_ids + [7], GREEDY) for o in got]
    hits_before = spec.block_manager.prefix_cache_hits
    assert [o.token_ids for o in run(spec, second)] == [o.token_ids for o in run(plain, second)]
    assert spec.block_manager.prefix_cache_hits > hits_before
    assert_drafts_were_tested(spec)
    assert_no_blocks_held(spec)


def test_bf16_batch_of_16_verifying_3_drafts_matches_plain_decoding(default_model_path):
    """SmolLM2 in bf16, 16 sequences, 3 drafts each: 64 rows would run the linears on F.linear
    where the plain step's 16 run the GEMV, and bf16 logits tie often enough that the other
    kernel's ulps change outputs here (checked with the cut disabled: the test fails). The
    engine cuts the drafts so the verifying step keeps the plain step's kernel (and the attention
    kernel gives a query the same bits in any call), and gives no drafts in steps that prefill
    (their decode rows run the prefill's kernels): every output is plain decoding's."""
    import inspect
    import json.decoder
    import textwrap

    # A token budget that splits the prompts over steps shared with decode rows.
    args = dict(dtype="bfloat16", enable_prefix_caching=False, max_num_batched_tokens=512)
    path = default_model_path
    spec = LLM(path, speculative="ngram", num_draft_tokens=3, draft_policy="fixed", **args)
    assert spec.engine.runner.gemv_row_limit == 32
    plain = LLM(path, **args)
    source = textwrap.dedent(inspect.getsource(json.decoder))  # text no one here wrote
    lines = source.splitlines(keepends=True)
    texts = ["".join(lines[20 * i : 20 * i + 12]) * 2 for i in range(16)]  # repeats: drafts
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    requests = [(spec.tokenizer.encode(text)[:-40], params) for text in texts]
    got = run(spec.engine, requests)
    want = run(plain.engine, requests)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert_drafts_were_tested(spec.engine)


@pytest.mark.slow  # SmolLM2's graphs of 1 x 1 and 1 x 4 tokens, compiled (~1-2 min)
def test_compiled_verifying_graph_gives_a_token_the_plain_graphs_bits(default_model_path):
    """bf16, compiled: a verifying graph (1 row x 4 tokens) must give each token the bits the
    plain step's graph (1 x 1) gives it. Inductor kept a fused kernel's 16-bit intermediates in
    fp32, and which ops fuse depends on the graph's shape (SmolLM2 with drafts left plain
    decoding's tokens at token 61; the tiny models' graphs fuse alike at both shapes). The
    drafts are plain decoding's own next tokens, so every draft is accepted and every
    log-probability equal, bit for bit, or the graphs differ."""
    import inspect
    import json.decoder

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    args = dict(dtype="bfloat16", compile=True, max_num_seqs=1, enable_prefix_caching=False)
    plain_llm = LLM(default_model_path, **args)
    prompt = plain_llm.tokenizer.encode(inspect.getsource(json.decoder))[:192]
    plain = plain_llm.generate([prompt], params)[0]
    spec = LLM(default_model_path, speculative="ngram", num_draft_tokens=3, draft_policy="fixed",
               **args)  # fmt: skip

    def plain_decodings_next_tokens(seqs, max_num_tokens):
        done = [len(seq.token_ids) - len(prompt) for seq in seqs]
        return [plain.token_ids[d : d + n] for d, n in zip(done, max_num_tokens)]

    spec.engine.drafter.propose = plain_decodings_next_tokens
    out = spec.generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids
    assert out.logprobs == plain.logprobs
    totals = spec.engine.spec_totals
    assert totals["num_accepted_tokens"] == totals["num_draft_tokens"] > 0
    assert 4 in {width for _, _, width in spec.engine.runner.graphs.graphs}


def test_num_draft_tokens_is_validated(tiny_checkpoint):
    path = tiny_checkpoint("llama").path
    plain = LLM(path, kv_cache_bytes=1 << 20)
    with pytest.raises(ValidationError, match="needs an engine built with speculative"):
        plain.generate([[5, 6, 7]], SamplingParams(num_draft_tokens=2))
    spec = LLM(path, kv_cache_bytes=1 << 20, speculative="ngram", num_draft_tokens=2)
    with pytest.raises(ValidationError, match="more than the engine's 2"):
        spec.generate([[5, 6, 7]], SamplingParams(num_draft_tokens=3))
    with pytest.raises(ValidationError, match="num_draft_tokens must be >= 0"):
        SamplingParams(num_draft_tokens=-1)
    with pytest.raises(ValidationError, match="draft_skip_layers"):
        LLM(path, kv_cache_bytes=1 << 20, speculative="skip_layers", draft_skip_layers=(0, 1))


def test_metrics_follow_the_engine_under_vllm_spec_decode_names(tiny_checkpoint):
    from zcode.server.metrics import Metrics

    llm = LLM(
        tiny_checkpoint("llama").path, kv_cache_bytes=1 << 20, speculative="ngram",
        draft_policy="fixed",
    )  # fmt: skip
    llm.generate(prompts()[-1:], GREEDY)
    totals, per_pos = llm.engine.spec_totals, llm.engine.spec_accepted_per_pos
    metrics = Metrics("m")
    metrics.engine_stats(llm.engine.stats())
    text = metrics.render().decode()
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert f'zcode:spec_decode_{key}_total{{model_name="m"}} {float(totals[key])}' in text
    for position, count in enumerate(per_pos):
        if count:
            line = f'per_pos_total{{model_name="m",position="{position}"}} {float(count)}'
            assert line in text
    assert sum(per_pos) == totals["num_accepted_tokens"] > 0


def test_cli_speculative_options(tiny_checkpoint, capsys):
    from zcode import cli

    path = str(tiny_checkpoint("llama").path)
    capsys.readouterr()  # building the checkpoint writes progress to stderr
    for argv, message in [
        (["generate", "hi", "--num-draft-tokens", "2"], "need --speculative"),
        (["generate", "hi", "--draft-policy", "fixed"], "need --speculative"),
        (["generate", "hi", "--speculative", "ngram", "--num-draft-tokens", "0"], "at least 1"),
        (["generate", "hi", "--speculative", "ngram", "--draft-skip-layers", "1"], "skip_layers"),
        (["generate", "hi", "--draft-format", "int8"], "need --speculative"),
        (["generate", "hi", "--speculative", "ngram", "--draft-format", "int8"], "quantized"),
        (["generate", "hi", "--model", path, "--speculative", "mtp"], "llama has none"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(argv)
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith("zcode: error: ") and message in err


# ---- sampled: the target distribution ------------------------------------------------------------


class FixedDrafter(Drafter):
    """Proposes the same tokens every step: some accepted, some rejected."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids

    def propose(self, seqs, max_num_tokens):
        return [self.token_ids[:n] for n in max_num_tokens]


def oracle_joint(oracle, prompt: list[int], num_tokens: int, top_k: int) -> dict:
    """{output tokens: probability} of sampling at temperature 1 with top_k, by transformers."""
    joint = {(): 1.0}
    for _ in range(num_tokens):
        grown = {}
        for tokens, prob in joint.items():
            with torch.no_grad():
                logits = oracle(torch.tensor([prompt + list(tokens)])).logits[0, -1].double()
            top = logits.topk(top_k)
            for token, p in zip(top.indices.tolist(), torch.softmax(top.values, -1).tolist()):
                grown[tokens + (token,)] = prob * p
        joint = grown
    return joint


def test_sampled_outputs_keep_the_target_distribution(tiny_checkpoint, monkeypatch):
    """4 tokens at top_k 2: the first sampled at prefill, the next two verified as drafts, the
    fourth sampled after them; the joint distribution of the 16 outcomes against transformers."""
    checkpoint = tiny_checkpoint("llama")
    prompt, num_tokens, top_k, num_samples = random_ids(7, seed=3), 4, 2, 3000
    joint = oracle_joint(checkpoint.oracle, prompt, num_tokens, top_k)
    likely = max(joint, key=joint.get)  # drafts on the likeliest path: accepted often, not always
    outcomes = sorted(joint)
    probs = torch.tensor([joint[o] for o in outcomes], dtype=torch.float64)

    def statistic() -> float:
        llm = LLM(
            checkpoint.path, kv_cache_bytes=4 << 20, max_num_seqs=256, speculative="ngram",
            draft_policy="fixed",
        )  # fmt: skip
        llm.engine.drafter = FixedDrafter(list(likely[1:3]))
        requests = [
            (prompt, SamplingParams(max_tokens=num_tokens, top_k=top_k, seed=i, ignore_eos=True))
            for i in range(num_samples)
        ]
        counts = torch.zeros(len(outcomes), dtype=torch.float64)
        for out in run(llm.engine, requests):
            counts[outcomes.index(tuple(out.token_ids))] += 1
        assert_drafts_were_tested(llm.engine)
        return chi_square(counts, probs)

    right = statistic()
    monkeypatch.setattr("zcode.engine.sampler.rejection_sample", wrong_rule)
    wrong = statistic()
    print(f"chi-square {right:.1f} (rule), {wrong:.1f} (wrong rule), critical {critical(16):.1f}")
    assert right < critical(len(outcomes))
    assert wrong > critical(len(outcomes))  # the test can fail


# ---- the default model ---------------------------------------------------------------------------

DEFAULT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea,",
    "Rename the function add to plus:\n\ndef add(a, b):\n    return a + b\n\n\ndef plus(",
    [{"role": "user", "content": "List three prime numbers and say why they are prime."}],
]


@pytest.mark.slow  # ~250 forwards of SmolLM2 in float32 (~20 s)
def test_default_model_greedy_outputs_are_those_of_plain_decoding(default_llm):
    """SmolLM2 in float32 (int8 activations would make logits depend on how tokens are split
    into forwards): 64 tokens of 5 prompts with each drafter, beside a request that does not
    speculate in the same batch. Eager: compiled drafts and verification are proven against
    transformers on the tiny models (test_compiled_drafts_and_verification_give_transformers_
    outputs) and compiled SmolLM2 steps against eager ones (test_graph_cache.py); here compiling
    SmolLM2's graphs of each batch bucket and width, for the model and its draft, took ~9 min
    from a cold inductor cache, most of the slow target on CI's machine."""
    ids = [default_llm.encode(p) for p in DEFAULT_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    want = [o.token_ids for o in default_llm.generate(ids, params)]
    plain = dataclasses.replace(params, num_draft_tokens=0)
    for method in ("ngram", "skip_layers", "quantized"):
        config = dataclasses.replace(
            default_llm.config, speculative=method, num_draft_tokens=3, draft_policy="fixed"
        )
        engine = LLMEngine(default_llm.model, default_llm.tokenizer, config)
        got = run(engine, [(p, params) for p in ids] + [(ids[0], plain)])
        assert [o.token_ids for o in got] == want + want[:1], method
        assert engine.spec_totals["num_draft_tokens"] > 0
        rates = [o.plan.speculative["acceptance_rate"] for o in got[:-1]]
        print(f"SmolLM2 {method}: acceptance per prompt {rates}")


def test_server_requests_carry_num_draft_tokens():
    import pydantic

    from zcode.server.protocol import CompletionRequest

    request = CompletionRequest.model_validate({"prompt": "hi", "num_draft_tokens": 2})
    assert request.sampling_params(4, 0, None, None).num_draft_tokens == 2
    unset = CompletionRequest.model_validate({"prompt": "hi"})
    assert unset.sampling_params(4, 0, None, None).num_draft_tokens is None
    for bad in (-1, 1.5, "2"):
        with pytest.raises(pydantic.ValidationError):
            CompletionRequest.model_validate({"prompt": "hi", "num_draft_tokens": bad})

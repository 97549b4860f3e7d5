"""Gemma 3's sliding-window layers in every attention path: chunked prefill and decode past the
window, mixed batches, prefix-cache reuse, per-request layer skipping and compiled decode, each
against transformers 5.23.0 (the oracle) or the eager path; and proof that the window masks.

The tiny config (tests/tiny_models.py) has a window of GEMMA3_WINDOW = 4 positions, far shorter
than the sequences here, so a sliding layer that saw its whole context would be caught.
"""

import copy

import pytest
import torch
from paged_runner import PagedRunner
from test_parity import LOGIT_TOL, oracle_logits, prompt_ids
from tiny_models import GEMMA3_WINDOW, VOCAB

from zcode.config import EngineConfig
from zcode.engine.kv_cache import kv_bytes_per_token
from zcode.engine.llm_engine import LLMEngine
from zcode.forward_batch import ForwardBatch
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams

NAME = "gemma3_text"
BLOCK = 4
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def gemma(tiny_checkpoint):
    """(our model, transformers' model) sharing the same random weights."""
    ckpt = tiny_checkpoint(NAME)
    net, _ = load_model(ckpt.path)
    return net, ckpt.oracle


def random_ids(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a - b).abs().max().item()


def make_engine(net, num_blocks: int = 256, **config) -> LLMEngine:
    per_block = BLOCK * kv_bytes_per_token(net.attention_layers(), torch.float32)
    config = EngineConfig(kv_cache_bytes=num_blocks * per_block, block_size=BLOCK, **config)
    return LLMEngine(net, None, config)


def serve(engine: LLMEngine, batches: list[dict[str, list[int]]]) -> dict:
    """Serves each batch of {request id: prompt} to completion, one after the other."""
    final = {}
    for batch in batches:
        for request_id, p in batch.items():
            engine.add_request(p, GREEDY, request_id=request_id)
        while engine.has_unfinished():
            final |= {out.request_id: out for out in engine.step() if out.finished}
    return final


def oracle_greedy(oracle, prompt: list[int], num_new: int) -> list[int]:
    with torch.no_grad():
        out = oracle.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=num_new,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_window_mask_keeps_the_last_window_positions():
    # Sequence 0: 3 new tokens at positions 5..7; sequence 1: 1 new token at position 2, so its
    # rows 1 and 2 are padding.
    batch = ForwardBatch.build([3, 1], [8, 3], [[0, 1], [2]], block_size=4)
    got = batch.window_mask(3)[:, 0]  # [B, S, L]
    want = torch.zeros(2, 3, 8, dtype=torch.bool)
    want[0, 0, 3:6] = want[0, 1, 4:7] = want[0, 2, 5:8] = True
    want[1, 0, 0:3] = True
    want[1, 1:, 0] = True  # padding rows keep position 0: softmax never sees an empty row
    assert torch.equal(got, want)
    # Uniform decode (no attn_mask) and the compiled step's padded batch agree.
    uniform = ForwardBatch.build([1, 1], [6, 6], [[0, 1], [2, 3]], block_size=4)
    assert uniform.attn_mask is None
    assert uniform.window_mask(2)[0, 0, 0].tolist() == [False] * 4 + [True] * 2
    decode = ForwardBatch.build_decode([6, 2], [[0, 1], [2]], 4, num_padded=4, pad_block=9)
    rows = decode.window_mask(2)[:, 0, 0]  # [B, L]
    assert rows[0].tolist() == [False] * 4 + [True] * 2 + [False] * 2
    assert rows[1].tolist() == [True] * 2 + [False] * 6
    assert rows[2:, 0].all() and not rows[2:, 1:].any()  # padding rows


def test_chunked_prefill_and_decode_past_the_window_match_transformers(gemma):
    net, oracle = gemma
    ids = prompt_ids()
    want, _ = oracle_logits(oracle, ids)
    runner = PagedRunner(net)
    got, start = [], 0
    for size in (3, 1, 6, 2, 11, 9):  # chunks shorter and longer than the window
        got.append(runner.step({"seq": ids[start : start + size]})["seq"])
        start += size
    for token in ids[start:]:
        got.append(runner.step({"seq": [token]})["seq"])
    diff = max_diff(torch.cat(got), want)
    print(f"{NAME}: chunked prefill + decode max |logit diff| {diff:.3e}")
    assert diff <= LOGIT_TOL


def test_mixed_batch_matches_transformers(gemma):
    """Decodes, a fresh prefill and a chunk of a longer prefill in one step, each sequence of
    another length, against transformers' uncached logits of each."""
    net, oracle = gemma
    seqs = {"decoding": random_ids(13, 1), "fresh": random_ids(9, 2), "chunked": random_ids(22, 3)}
    runner = PagedRunner(net)
    first = runner.step({"decoding": seqs["decoding"][:12], "chunked": seqs["chunked"][:7]})
    second = runner.step(
        {"decoding": seqs["decoding"][12:], "fresh": seqs["fresh"], "chunked": seqs["chunked"][7:]}
    )
    for name, ids in seqs.items():
        want, _ = oracle_logits(oracle, ids)
        got = torch.cat([first[name], second[name]]) if name in first else second[name]
        assert max_diff(got, want) <= LOGIT_TOL, name


def test_the_window_masks(gemma):
    """The parity above is not vacuous: the same model with its windows removed is far from the
    oracle (a window that let everything through would pass nothing above)."""
    net, oracle = gemma
    ids = prompt_ids()
    want, _ = oracle_logits(oracle, ids)
    sliding = [a for a in net.attention_layers() if a.sliding_window is not None]
    assert len(sliding) == oracle.config.layer_types.count("sliding_attention") == 3
    assert all(a.sliding_window == GEMMA3_WINDOW for a in sliding)
    try:
        for a in sliding:
            a.sliding_window = None
        unwindowed = PagedRunner(net).prefill_then_decode("seq", ids, 32)
    finally:
        for a in sliding:
            a.sliding_window = GEMMA3_WINDOW
    effect = max_diff(unwindowed, want)
    print(f"{NAME}: attending past the window moves the logits by up to {effect:.3e}")
    assert effect > 100 * LOGIT_TOL
    # Within the window nothing changes: the first GEMMA3_WINDOW positions see all they have.
    assert max_diff(unwindowed[:GEMMA3_WINDOW], want[:GEMMA3_WINDOW]) <= LOGIT_TOL


def test_prefix_cache_reuse_matches_caching_off_and_transformers(gemma):
    """Requests that reuse a cached prefix longer than the window (their new tokens' windows
    reach into cached blocks) produce what they produce with caching off."""
    net, oracle = gemma
    system = random_ids(21, seed=4)  # 5 full blocks and one token
    first = {"first": system + random_ids(6, seed=5)}
    rest = {
        "second": system + random_ids(7, seed=6),
        "third": system + random_ids(2, seed=7),
        "repeat": first["first"],
    }
    cached = make_engine(net)
    got = serve(cached, [first, rest])
    assert cached.stats()["prefix_cache_hits"] == 20 + 20 + 24
    want = serve(make_engine(net, enable_prefix_caching=False), [first, rest])
    for request_id, out in want.items():
        assert got[request_id].token_ids == out.token_ids, request_id
        for a, b in zip(got[request_id].logprobs, out.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)
    repeat = rest["repeat"]
    assert got["repeat"].token_ids == oracle_greedy(oracle, repeat, GREEDY.max_tokens)


def test_per_request_layer_skipping_keeps_the_window(gemma):
    """Engine with KV pages per layer: a request skipping the full-attention layer 1 matches
    transformers without that layer (its layer_types shortened alike), next to one skipping
    nothing."""
    net, oracle = gemma
    engine = make_engine(net, per_request_depth=True)
    prompt = random_ids(19, seed=8)
    whole = engine.add_request(prompt, GREEDY)
    skipping = engine.add_request(prompt, GREEDY, skip_layers=[1])
    while engine.has_unfinished():
        engine.step()
    assert whole.output_token_ids == oracle_greedy(oracle, prompt, GREEDY.max_tokens)

    shallow = copy.deepcopy(oracle)
    shallow.model.layers = torch.nn.ModuleList(
        [layer for i, layer in enumerate(shallow.model.layers) if i != 1]
    )
    for i, layer in enumerate(shallow.model.layers):  # the oracle's cache is per layer_idx
        layer.layer_idx = layer.self_attn.layer_idx = i
    shallow.config.num_hidden_layers = 3
    shallow.config.layer_types = [t for i, t in enumerate(oracle.config.layer_types) if i != 1]
    assert skipping.output_token_ids == oracle_greedy(shallow.eval(), prompt, GREEDY.max_tokens)


# slow: compiles the decode graph (~24 s on 2 cores)
@pytest.mark.slow
def test_compiled_decode_matches_eager(gemma):
    """Compiled decode steps (build_decode's padded batch, decode_attention) with a window."""
    net, _ = gemma
    prompts = [random_ids(n, seed=n) for n in (5, 14)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2)

    def generate(engine: LLMEngine) -> list:
        seqs = [engine.add_request(p, params) for p in prompts]
        while engine.has_unfinished():
            engine.step()
        return [(s.output_token_ids, s.output_logprobs) for s in seqs]

    compiled = LLMEngine(
        net, None, EngineConfig(kv_cache_bytes=1 << 20, compile=True, max_num_seqs=2)
    )
    got = generate(compiled)
    assert compiled.stats()["num_graph_compiles"] > 0
    want = generate(LLMEngine(net, None, EngineConfig(kv_cache_bytes=1 << 20)))
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for a, b in zip(logprobs, want_logprobs, strict=True):
            assert list(a.values()) == pytest.approx(list(b.values()), abs=1e-4)


def test_kv_head_pruning_keeps_the_window_and_the_norm_offset(gemma):
    """zcode.sparsity's head pruning rebuilds attention modules: keeping every KV group must give
    back the same model, window, unit-offset q/k norms and score scale included."""
    from zcode.sparsity.head_skip import pruned_attention

    net, oracle = gemma
    pruned = copy.deepcopy(net)
    for layer in pruned.model.layers:
        attn = layer.self_attn
        layer.self_attn = pruned_attention(attn, list(range(attn.num_kv_heads)))
    ids = prompt_ids()
    want, _ = oracle_logits(oracle, ids)
    got = PagedRunner(pruned).prefill_then_decode("seq", ids, 32)
    assert max_diff(got, want) <= LOGIT_TOL

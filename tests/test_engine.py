"""The engine on a tiny random llama: stopping, streaming, validation, preemption, chunked prefill,
prompt log-probabilities and aborts.

The tiny model has no tokenizer; a fake one spells token i as a fixed two-letter piece, so a
three-letter stop string always spans two tokens.
"""

import copy
import string

import pytest
import torch

from zcode.config import EngineConfig
from zcode.engine.kv_cache import kv_bytes_per_token
from zcode.engine.llm_engine import LLMEngine
from zcode.errors import ValidationError
from zcode.sampling_params import SamplingParams

EOS = 1  # tiny_models' eos_token_id


class PieceTokenizer:
    """Token i decodes to letters[i % 26] + letters[i // 26]; all the engine asks of a tokenizer."""

    eos_token_id = EOS

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        letters = string.ascii_lowercase
        return "".join(letters[i % 26] + letters[i // 26] for i in token_ids)


@pytest.fixture(scope="module")
def tiny(tiny_model):
    """(our model, transformers' model) sharing the same random llama weights."""
    return tiny_model("llama")


def _engine(net, **config) -> LLMEngine:
    # A new engine gives the model a new KV cache: engines made earlier must not be stepped again.
    # 1 MiB holds 2048 tokens of the tiny model; the 1 GiB default would take a while to zero.
    config.setdefault("kv_cache_bytes", 1 << 20)
    return LLMEngine(net, PieceTokenizer(), EngineConfig(**config))


def _prompt(length: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (length,), generator=generator).tolist()


def _run(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams):
    """Runs the prompts together; returns (final outputs, concatenated streamed deltas)."""
    seqs = [engine.add_request(p, params) for p in prompts]
    streamed = {seq.request_id: "" for seq in seqs}
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            streamed[out.request_id] += out.delta_text
            if out.finished:
                final[out.request_id] = out
    return [final[s.request_id] for s in seqs], [streamed[s.request_id] for s in seqs]


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny):
    """The greedy continuation of one prompt, unhindered, for the stop tests to cut into."""
    prompt = _prompt(9, seed=1)
    [out], _ = _run(_engine(tiny[0]), [prompt], GREEDY)
    return prompt, out


def test_max_tokens_finishes_with_length(tiny, reference):
    prompt, out = reference
    assert out.finish_reason == "length" and out.stop_reason is None
    assert len(out.token_ids) == GREEDY.max_tokens
    assert out.text == PieceTokenizer().decode(out.token_ids)
    # transformers' greedy continuation of the same prompt
    with torch.no_grad():
        expected = tiny[1].generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None
        )
    assert out.token_ids == expected[0, len(prompt) :].tolist()


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tiny, reference, include):
    prompt, full = reference
    stop = full.text[9:12]  # the second half of token 4 and the first of token 5
    index = full.text.find(stop)
    params = SamplingParams(
        max_tokens=12,
        temperature=0,
        ignore_eos=True,
        stop=("not-there", stop),
        include_stop_str_in_output=include,
    )
    [out], [streamed] = _run(_engine(tiny[0]), [prompt], params)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: index + len(stop) if include else index]
    assert streamed == out.text
    assert out.token_ids == full.token_ids[: (index + len(stop) + 1) // 2]


def test_streamed_deltas_hold_back_a_possible_stop_string(tiny, reference):
    prompt, full = reference
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=("zzzzz",))
    engine = _engine(tiny[0])
    seq = engine.add_request(prompt, params)
    deltas = []
    while engine.has_unfinished():
        for out in engine.step():
            deltas.append(out.delta_text)
            if not out.finished:
                # at most len(stop) - 1 characters are held back
                assert len(out.text) - len("".join(deltas)) <= 4
    assert seq.finish_reason == "length"
    assert "".join(deltas) == out.text == full.text


def test_stop_token_ids(tiny, reference):
    prompt, full = reference
    stop_token = full.token_ids[3]
    params = SamplingParams(
        max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_token]
    )
    [out], [streamed] = _run(_engine(tiny[0]), [prompt], params)
    first = full.token_ids.index(stop_token)
    assert out.finish_reason == "stop" and out.stop_reason == stop_token
    assert out.token_ids == full.token_ids[: first + 1]
    assert streamed == out.text


def test_eos_stops_unless_ignored(tiny, reference):
    prompt, full = reference
    engine = _engine(tiny[0])
    engine.eos_token_ids = {full.token_ids[2]}
    [out], _ = _run(engine, [prompt], SamplingParams(max_tokens=12, temperature=0))
    assert out.finish_reason == "stop" and out.stop_reason is None
    assert out.token_ids == full.token_ids[:3]


def test_prompt_too_long(tiny):
    engine = _engine(tiny[0], max_model_len=64)
    with pytest.raises(ValidationError) as info:
        engine.add_request(_prompt(60, seed=0), SamplingParams(max_tokens=10))
    message = str(info.value)
    assert "maximum context length is 64 tokens" in message
    assert "70 were requested (60 in the prompt, 10 to generate)" in message
    engine.add_request(_prompt(54, seed=0), SamplingParams(max_tokens=10))  # exactly fits


@pytest.mark.parametrize(
    ("prompt", "match"),
    [([5, 256, 7], "out of vocabulary.*256"), ([-1], "out of vocabulary"), ([], "empty")],
)
def test_invalid_prompts(tiny, prompt, match):
    engine = _engine(tiny[0])
    with pytest.raises(ValidationError, match=match):
        engine.add_request(prompt, SamplingParams())
    assert not engine.has_unfinished()


def _alone(net, prompts, params) -> list[list[int]]:
    return [_run(_engine(net), [p], params)[0][0].token_ids for p in prompts]


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)],
    ids=["greedy", "seeded"],
)
def test_preemption_gives_the_same_outputs(tiny, params):
    net = tiny[0]
    prompts = [_prompt(n, seed=n) for n in (10, 13, 11, 12)]
    block_size = 4
    # Each sequence needs up to 25 tokens = 7 blocks; 10 blocks cannot hold four of them.
    kv_bytes = 10 * block_size * kv_bytes_per_token(net.attention_layers(), torch.float32)
    engine = _engine(net, kv_cache_bytes=kv_bytes, block_size=block_size)
    assert engine.block_manager.num_blocks == 10
    outputs, _ = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == _alone(net, prompts, params)
    assert engine.block_manager.num_free_blocks == 10


def test_chunked_prefill_matches_unchunked(tiny):
    net = tiny[0]
    prompts = [_prompt(40, seed=3), _prompt(23, seed=4)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=2)
    whole, _ = _run(_engine(net), prompts, params)
    chunked, _ = _run(_engine(net, max_num_batched_tokens=16), prompts, params)
    for a, b in zip(whole, chunked, strict=True):
        assert a.token_ids == b.token_ids
        assert len(a.prompt_logprobs) == len(b.prompt_logprobs) == len(a.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys()
            assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-5)


def test_prompt_logprobs_match_transformers(tiny):
    net, oracle = tiny
    prompt = _prompt(20, seed=6)
    params = SamplingParams(max_tokens=1, prompt_logprobs=3, logprobs=2, temperature=0)
    [out], _ = _run(_engine(net, max_num_batched_tokens=8), [prompt], params)
    with torch.no_grad():
        expected = torch.log_softmax(oracle(torch.tensor([prompt])).logits[0].double(), dim=-1)
    assert out.prompt_logprobs[0] is None
    assert len(out.prompt_logprobs) == len(prompt)
    for position in range(1, len(prompt)):
        entry = out.prompt_logprobs[position]
        row = expected[position - 1]  # logits at position p - 1 predict token p
        assert set(entry) == {prompt[position], *row.topk(3).indices.tolist()}
        for token, value in entry.items():
            assert value == pytest.approx(float(row[token]), abs=1e-4)
    [sampled] = out.token_ids
    assert sampled == int(expected[-1].argmax())
    assert out.logprobs[0][sampled] == pytest.approx(float(expected[-1, sampled]), abs=1e-4)


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny):
    net = tiny[0]
    block_size = 4
    prompts = [_prompt(30, seed=7), _prompt(30, seed=8)]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, prompt_logprobs=1)
    alone = [_run(_engine(net), [p], params)[0][0] for p in prompts]
    kv_bytes = 12 * block_size * kv_bytes_per_token(net.attention_layers(), torch.float32)
    engine = _engine(net, kv_cache_bytes=kv_bytes, block_size=block_size, max_num_batched_tokens=8)
    crowded, _ = _run(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    for a, b in zip(alone, crowded, strict=True):
        assert a.token_ids == b.token_ids
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert x.keys() == y.keys()


def test_abort_frees_blocks(tiny):
    engine = _engine(tiny[0], block_size=4)
    total = engine.block_manager.num_blocks
    running = engine.add_request(_prompt(10, seed=9), GREEDY, request_id="running")
    engine.step()
    waiting = engine.add_request(_prompt(10, seed=10), GREEDY, request_id="waiting")
    assert engine.block_manager.num_free_blocks < total
    engine.abort("waiting")
    engine.abort("running")
    assert running.finish_reason == waiting.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == total
    assert not engine.has_unfinished() and engine.step() == []
    engine.abort("running")  # aborting twice, or an unknown id, is a no-op
    engine.abort("never-seen")


def test_anomaly_guard_ends_a_request_whose_weights_turn_nan(tiny):
    """Fault injection: NaN in one layer's weights. The request ends at the first broken token
    with finish_reason "anomaly" (its kind as stop_reason) instead of emitting garbage."""
    net, _ = tiny
    broken = copy.deepcopy(net)
    with torch.no_grad():
        broken.model.layers[1].mlp.down_proj.weight[0, 0] = float("nan")
    engine = _engine(broken)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    [out], _ = _run(engine, [_prompt(12, seed=3)], params)
    assert (out.finish_reason, out.stop_reason) == ("anomaly", "nan_logits")
    assert len(out.token_ids) == 1
    assert not engine.has_unfinished()


def test_anomaly_guard_ends_only_the_request_whose_kv_is_corrupted(tiny):
    """Fault injection: one request's KV blocks overwritten with NaN after its prefill (a KV
    race). That request ends as an anomaly within one token; the request beside it runs on, token
    for token as it runs alone."""
    net, _ = tiny
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    healthy, victim = _prompt(9, seed=4), _prompt(11, seed=5)
    [alone], _ = _run(_engine(net), [healthy], params)
    engine = _engine(net)
    seqs = [engine.add_request(p, params) for p in (healthy, victim)]
    engine.step()  # both prefills, one token each
    for attn in net.attention_layers():
        for cache in attn.cache.values():
            cache[seqs[1].block_table] = float("nan")
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    assert (final[seqs[1].request_id].finish_reason, final[seqs[1].request_id].stop_reason) == (
        "anomaly",
        "nan_logits",
    )
    assert len(final[seqs[1].request_id].token_ids) == 2
    assert final[seqs[0].request_id].token_ids == alone.token_ids
    assert final[seqs[0].request_id].finish_reason == "length"


def test_engine_freezes_what_is_alive_once_ready(tiny):
    """The model, tokenizer and graphs alive at start-up leave the garbage collector's walks
    (gc.freeze); objects that die later are still freed."""
    import gc
    import weakref

    gc.unfreeze()
    engine = _engine(tiny[0])
    assert gc.get_freeze_count() > 0
    assert not any(o is engine.model for o in gc.get_objects())  # in no generation: frozen

    class Garbage:
        pass

    cycle = Garbage()
    cycle.me = cycle
    alive = weakref.ref(cycle)
    del cycle
    _run(engine, [_prompt(5, seed=2)], GREEDY)  # no compile: nothing frozen again
    gc.collect()
    assert alive() is None


def test_an_engine_dropped_in_a_cycle_is_freed_by_the_next_freeze(tiny):
    """A frozen engine kept only by a reference cycle is freed when the next engine freezes the
    heap (it unfreezes and collects first): a process that loads model after model does not
    keep them all."""
    import gc
    import weakref

    first = _engine(tiny[0])
    first.me = first  # a cycle: reference counts never free it
    gone = weakref.ref(first)
    del first
    gc.collect()  # the frozen cycle is not walked
    assert gone() is not None
    _engine(tiny[0])
    assert gone() is None

"""Prefix caching: block hashing, reference counts and LRU eviction in the block manager, then
the engine on tiny llama and GLM-5 (MLA + DSA indexer) checkpoints.

Engine outputs with prefix caching are compared with the same requests served with caching off
(and, for a repeated prompt, with transformers' greedy generation), and the number of tokens the
model actually ran is checked against the number the cache should have saved.
"""

import pytest
import torch
from tiny_models import VOCAB

from zcode.config import EngineConfig
from zcode.engine.block_manager import BlockManager
from zcode.engine.kv_cache import kv_bytes_per_token
from zcode.engine.llm_engine import LLMEngine
from zcode.engine.sequence import Sequence
from zcode.errors import ValidationError
from zcode.harness.executor import PlanExecutor
from zcode.harness.plan import ExecutionPlan
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams

BLOCK = 4

# ---- the block manager alone ---------------------------------------------------------------------


def seq_of(token_ids: list[int], **params) -> Sequence:
    return Sequence(token_ids, SamplingParams(**params), detokenizer=None)


def compute_and_free(bm: BlockManager, seq: Sequence) -> tuple[int, ...]:
    """Admits `seq` with its cached prefix, "computes" all its tokens, frees it; returns the
    prefix it was given."""
    prefix = bm.cached_prefix(seq)
    num_new = seq.num_tokens - len(prefix) * BLOCK
    assert bm.can_allocate(seq, num_new, prefix)
    bm.allocate(seq, num_new, prefix)
    seq.num_computed_tokens = seq.num_tokens
    bm.free(seq)
    return prefix


def ids(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def test_a_block_is_found_only_after_the_same_prefix():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    a, b, x = ids(10, 4), ids(20, 4), ids(30, 4)
    assert compute_and_free(bm, seq_of(a + x + [5])) == ()
    assert len(bm.cached_prefix(seq_of(a + x + [6]))) == 2
    assert len(bm.cached_prefix(seq_of(a + ids(40, 4) + [6]))) == 1
    assert bm.cached_prefix(seq_of(b + x + [5])) == ()  # same block, another prefix
    assert bm.cached_prefix(seq_of(x + a + [5])) == ()  # same blocks, other positions


@pytest.mark.parametrize(("length", "reused"), [(16, 12), (17, 16), (5, 4), (4, 0)])
def test_at_least_one_token_is_left_to_compute(length, reused):
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    compute_and_free(bm, seq_of(ids(10, 20)))
    repeat = seq_of(ids(10, length))
    assert len(compute_and_free(bm, repeat)) * BLOCK == reused
    assert repeat.num_cached_tokens == reused
    assert bm.prefix_cache_queries == 20 + length and bm.prefix_cache_hits == reused


def test_shared_blocks_are_reference_counted():
    bm = BlockManager(num_blocks=8, block_size=BLOCK)
    compute_and_free(bm, seq_of(ids(10, 9)))  # two full blocks cached, one freed uncached
    assert bm.num_evictable_blocks == 2 and bm.num_free_blocks == 8 and bm.usage == 0.0
    first, second = seq_of(ids(10, 10)), seq_of(ids(10, 11))
    for seq in (first, second):
        prefix = bm.cached_prefix(seq)
        bm.allocate(seq, seq.num_tokens - 8, prefix)
    assert first.block_table[:2] == second.block_table[:2]
    assert [bm.ref_counts[b] for b in first.block_table] == [2, 2, 1]
    assert bm.num_evictable_blocks == 0 and bm.usage == 4 / 8
    bm.free(first)
    assert [bm.ref_counts[b] for b in second.block_table] == [1, 1, 1]
    bm.free(second)
    assert bm.usage == 0.0 and max(bm.ref_counts) == 0
    assert len(bm.free_block_ids) + bm.num_evictable_blocks == bm.num_blocks


def test_least_recently_used_blocks_are_evicted_first_tail_before_head():
    bm = BlockManager(num_blocks=6, block_size=BLOCK)
    old, new = ids(10, 9), ids(50, 9)
    compute_and_free(bm, seq_of(old))
    compute_and_free(bm, seq_of(new))
    assert len(compute_and_free(bm, seq_of(old + [1]))) == 2  # reuse makes `old` recent
    assert bm.num_evictable_blocks == 4 and len(bm.free_block_ids) == 2
    # 3 blocks needed: the 2 free ones, then `new`'s tail block (least recently used).
    compute_and_free(bm, seq_of(ids(100, 3 * BLOCK), prompt_logprobs=0))
    assert len(bm.cached_prefix(seq_of(new + [1]))) == 1
    assert len(bm.cached_prefix(seq_of(old + [1]))) == 2
    assert len(bm.hash_to_block_id) == bm.num_evictable_blocks  # evicted hashes are forgotten


def test_prompt_logprob_requests_skip_the_cache_and_the_counters():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    compute_and_free(bm, seq_of(ids(10, 20)))
    assert compute_and_free(bm, seq_of(ids(10, 20), prompt_logprobs=1)) == ()
    assert bm.prefix_cache_queries == 20 and bm.prefix_cache_hits == 0


def test_blocks_are_shared_under_equal_salts_only():
    bm = BlockManager(num_blocks=16, block_size=BLOCK)
    p = ids(10, 9)
    compute_and_free(bm, Sequence(p, SamplingParams(), None, cache_salt="tenant a"))
    assert bm.cached_prefix(seq_of(p)) == ()
    assert bm.cached_prefix(Sequence(p, SamplingParams(), None, cache_salt="tenant b")) == ()
    assert len(bm.cached_prefix(Sequence(p, SamplingParams(), None, cache_salt="tenant a"))) == 2
    compute_and_free(bm, seq_of(p))
    assert len(bm.cached_prefix(seq_of(p))) == 2  # unsalted requests share among themselves


def test_disabled_caching_keeps_nothing():
    bm = BlockManager(num_blocks=8, block_size=BLOCK, enable_prefix_caching=False)
    compute_and_free(bm, seq_of(ids(10, 20)))
    assert compute_and_free(bm, seq_of(ids(10, 20))) == ()
    assert bm.num_evictable_blocks == 0 and not bm.hash_to_block_id
    assert bm.prefix_cache_queries == bm.prefix_cache_hits == 0


# ---- the engine -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def nets(tiny_checkpoint):
    loaded = {}

    def get(name: str):
        if name not in loaded:
            loaded[name] = load_model(tiny_checkpoint(name).path)[0]
        return loaded[name]

    return get


def make_engine(net, num_blocks: int = 256, **config) -> LLMEngine:
    # A new engine gives the model a new KV cache: engines made earlier must not be stepped again.
    per_block = BLOCK * kv_bytes_per_token(net.attention_layers(), torch.float32)
    config = EngineConfig(kv_cache_bytes=num_blocks * per_block, block_size=BLOCK, **config)
    return LLMEngine(net, None, config)


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(
        3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


class Recorder:
    """Wraps the model runner to record (request id, first new position, new tokens) per step."""

    def __init__(self, engine: LLMEngine) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.execute = engine.runner.execute
        engine.runner.execute = self

    def __call__(self, scheduled, row_settings=None):
        self.calls += [
            (s.seq.request_id, s.seq.num_computed_tokens, s.num_new_tokens) for s in scheduled
        ]
        return self.execute(scheduled, row_settings)

    def tokens_run(self, request_id: str) -> int:
        return sum(n for rid, _, n in self.calls if rid == request_id)


def run(engine: LLMEngine, batches: list[dict[str, list[int]]], params=GREEDY) -> dict:
    """Serves each batch of {request id: prompt} to completion, one batch after the other."""
    final = {}
    for batch in batches:
        for request_id, p in batch.items():
            engine.add_request(p, params, request_id=request_id)
        while engine.has_unfinished():
            for out in engine.step():
                assert min(engine.block_manager.ref_counts) >= 0
                if out.finished:
                    final[out.request_id] = out
    return final


def assert_same_outputs(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for request_id in want:
        a, b = got[request_id], want[request_id]
        assert a.token_ids == b.token_ids, request_id
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-4)


def assert_idle(engine: LLMEngine) -> None:
    bm, stats = engine.block_manager, engine.stats()
    assert stats["kv_usage"] == 0.0 and stats["num_running"] == stats["num_waiting"] == 0
    assert stats["num_free_blocks"] == stats["num_blocks"] == bm.num_blocks
    assert len(bm.free_block_ids) + bm.num_evictable_blocks == bm.num_blocks
    assert max(bm.ref_counts) == 0


@pytest.mark.parametrize("name", ["llama", "glm_moe_dsa"])
def test_shared_prefix_outputs_match_caching_off(nets, name):
    net = nets(name)
    system = prompt(37, seed=1)  # 9 full blocks and one token
    first = {"first": system + prompt(6, seed=2)}
    # Admitted together after `first`: each reuses its 9 blocks; the repeat reuses 10 of 11.
    rest = {
        "second": system + prompt(9, seed=3),
        "third": system + prompt(3, seed=4),
        "repeat": first["first"],
    }
    cached_engine = make_engine(net)
    recorder = Recorder(cached_engine)
    got = run(cached_engine, [first, rest])
    want = run(make_engine(net, enable_prefix_caching=False), [first, rest])
    assert_same_outputs(got, want)
    stats = cached_engine.stats()
    assert stats["prefix_cache_hits"] == 36 + 36 + 40
    assert stats["prefix_cache_queries"] == sum(len(p) for p in (*first.values(), *rest.values()))
    assert recorder.tokens_run("second") == 46 - 36 + GREEDY.max_tokens - 1
    assert recorder.tokens_run("repeat") == 43 - 40 + GREEDY.max_tokens - 1
    assert_idle(cached_engine)


def test_second_request_computes_only_its_uncached_tokens(nets):
    engine = make_engine(nets("llama"))
    recorder = Recorder(engine)
    system = prompt(4 * BLOCK, seed=5)
    run(engine, [{"a": system + prompt(6, seed=6)}])
    before = engine.stats()
    run(engine, [{"b": system + prompt(5, seed=7)}])
    after = engine.stats()
    assert [c for c in recorder.calls if c[0] == "b"][0] == ("b", 16, 5)
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 16
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == 21


def test_engine_salts_keep_prefixes_apart(nets):
    engine = make_engine(nets("llama"))
    p = prompt(4 * BLOCK + 1, seed=9)

    # Another plan of the model, one that changes nothing the executor moves: only its salt.
    other = ExecutionPlan(name="other", extras=(("test", "another plan"),))
    engine.executor = PlanExecutor(engine)

    def hits_of(cache_salt: str | None = None, plan: ExecutionPlan | None = None) -> int:
        before = engine.stats()["prefix_cache_hits"]
        engine.add_request(p, GREEDY, cache_salt=cache_salt, plan=plan)
        while engine.has_unfinished():
            engine.step()
        return engine.stats()["prefix_cache_hits"] - before

    assert hits_of() == 0
    assert hits_of("a") == 0 and hits_of("a") == 16
    assert hits_of(plan=other) == 0 and hits_of("a", other) == 0 and hits_of(plan=other) == 16
    assert hits_of() == 16
    with pytest.raises(ValidationError, match="cache_salt must be a string"):
        engine.add_request(p, GREEDY, cache_salt=b"a")


@pytest.mark.parametrize("length", [16, 18])
def test_a_repeated_prompt_matches_transformers(nets, tiny_checkpoint, length):
    engine = make_engine(nets("llama"))
    p = prompt(length, seed=8)
    outputs = run(engine, [{"once": p}, {"twice": p}])
    assert engine.stats()["prefix_cache_hits"] == (length - 1) // BLOCK * BLOCK
    with torch.no_grad():
        expected = tiny_checkpoint("llama").oracle.generate(
            torch.tensor([p]), max_new_tokens=GREEDY.max_tokens, do_sample=False, eos_token_id=None
        )[0, length:]
    assert outputs["once"].token_ids == outputs["twice"].token_ids == expected.tolist()


def test_eviction_under_a_full_cache_keeps_outputs_correct(nets):
    net = nets("llama")
    prompts = {f"p{i}": prompt(18, seed=10 + i) for i in range(8)}
    # 24 blocks: each request holds 7 while running (25 tokens) and leaves 6 cached behind;
    # the cache holds the blocks of at most 4 finished requests.
    engine = make_engine(net, num_blocks=24)
    got = run(engine, [{k: v} for k, v in prompts.items()])
    assert engine.block_manager.num_evictable_blocks == 24 - 1
    hits = engine.stats()["prefix_cache_hits"]
    again = run(engine, [{"p0-again": prompts["p0"]}, {"p7-again": prompts["p7"]}])
    assert engine.stats()["prefix_cache_hits"] - hits == 16  # p0 was evicted; p7 still cached
    got.update(again)
    want = run(make_engine(net, enable_prefix_caching=False), [prompts])
    want.update({f"{k}-again": want[k] for k in ("p0", "p7")})
    assert_same_outputs(got, want)
    assert_idle(engine)


def test_abort_mid_prefill_and_mid_decode_frees_blocks(nets):
    net = nets("llama")
    p = prompt(30, seed=20)
    want = run(make_engine(net, enable_prefix_caching=False), [{"r": p}])["r"]
    engine = make_engine(net, num_blocks=32, max_num_batched_tokens=12)
    engine.add_request(p, GREEDY, request_id="prefilling")
    engine.step()  # 12 of 30 prompt tokens computed
    assert engine.stats()["kv_usage"] > 0
    engine.abort("prefilling")
    assert_idle(engine)
    engine.add_request(p, GREEDY, request_id="decoding")
    for _ in range(5):  # 12 tokens cached, two prefill chunks of 12 and 6, three decode steps
        engine.step()
    assert engine.stats()["prefix_cache_hits"] == 12  # what the aborted prefill left cached
    assert engine.sequences["decoding"].num_output_tokens == 4
    engine.abort("decoding")
    assert_idle(engine)
    # Blocks published by aborted requests hold correct KV: the same prompt once more.
    got = run(engine, [{"last": p}])["last"]
    assert engine.stats()["prefix_cache_hits"] == 12 + 28
    assert_same_outputs({"r": got}, {"r": want})


@pytest.mark.parametrize(
    "params",
    [GREEDY, SamplingParams(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True, logprobs=2)],
    ids=["greedy", "seeded"],
)
def test_preemption_with_prefix_caching_matches_alone(nets, params):
    net = nets("llama")
    system = prompt(13, seed=30)
    prompts = {f"r{i}": system + prompt(n, seed=31 + i) for i, n in enumerate((3, 6, 1, 4))}
    alone = {}
    for request_id, p in prompts.items():
        alone.update(run(make_engine(net, enable_prefix_caching=False), [{request_id: p}], params))
    # Each request grows to at most 27 tokens = 7 blocks; 12 blocks cannot hold four of them.
    engine = make_engine(net, num_blocks=12)
    got = run(engine, [prompts], params)
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    assert_same_outputs(got, alone)
    assert_idle(engine)


def test_prompt_logprobs_are_complete_after_a_cached_prefix(nets):
    net = nets("llama")
    p = prompt(21, seed=40)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    engine = make_engine(net)
    run(engine, [{"warm": p}])
    hits = engine.stats()["prefix_cache_hits"]
    got = run(engine, [{"r": p}], params)["r"]
    want = run(make_engine(net, enable_prefix_caching=False), [{"r": p}], params)["r"]
    assert engine.stats()["prefix_cache_hits"] == hits
    assert len(got.prompt_logprobs) == len(p) and got.token_ids == want.token_ids
    for x, y in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
        assert list(x.values()) == pytest.approx(list(y.values()), abs=1e-4)

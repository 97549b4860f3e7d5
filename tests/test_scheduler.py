"""The scheduler and block manager without a model, then the engine's hardening on a tiny llama.

Model-free: a fake runner stands in for the model. It "writes" for every computed position a
value that depends on all tokens up to it (what real KV does) and checks, for every position a
sequence attends to, that its cache slot holds that sequence's own value. Shared prefixes,
eviction and preemption must therefore never hand a sequence the wrong KV, and a step must
never write into a block another sequence also holds.

Engine: requests that can never fit are rejected at once, aborts free blocks, a long queue
under a tiny token budget drains, and one failing request is finished with "error" while the
others carry on with the outputs they would have had alone.
"""

import random

import pytest
import torch
from tiny_models import VOCAB

from zcode.config import EngineConfig
from zcode.engine.block_manager import BlockManager
from zcode.engine.kv_cache import kv_bytes_per_token
from zcode.engine.llm_engine import LLMEngine
from zcode.engine.scheduler import Scheduler
from zcode.engine.sequence import Sequence, SequenceStatus
from zcode.errors import ValidationError
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams


class FakeRunner:
    """A model whose KV at position p is the tuple of tokens 0..p and whose next token is a
    function of the whole sequence, so equal prefixes give equal KV and equal continuations."""

    def __init__(self, bm: BlockManager) -> None:
        self.bm = bm
        self.slots: dict[int, tuple[int, ...]] = {}
        self.num_tokens_run = 0

    def slot(self, seq: Sequence, position: int) -> int:
        size = self.bm.block_size
        return seq.block_table[position // size] * size + position % size

    def execute(self, scheduled) -> None:
        for s in scheduled:
            seq, start = s.seq, s.seq.num_computed_tokens
            end = start + s.num_new_tokens
            assert len(seq.block_table) * self.bm.block_size >= end
            assert len(set(seq.block_table)) == len(seq.block_table)
            for p in range(start, end):
                slot = self.slot(seq, p)
                assert self.bm.ref_counts[slot // self.bm.block_size] == 1, "wrote a shared block"
                self.slots[slot] = tuple(seq.token_ids[: p + 1])
            for p in range(end):
                assert self.slots.get(self.slot(seq, p)) == tuple(seq.token_ids[: p + 1]), (
                    f"seq {seq.seq_id} position {p} reads someone else's KV"
                )
            self.num_tokens_run += s.num_new_tokens

    @staticmethod
    def next_token(seq: Sequence) -> int:
        return 3 + hash(tuple(seq.token_ids)) % (VOCAB - 3)


def check_block_accounting(bm: BlockManager, running: list[Sequence]) -> None:
    held = [b for seq in running for b in seq.block_table]
    assert all(count >= 0 for count in bm.ref_counts)
    assert sum(bm.ref_counts) == len(held)
    assert set(held).isdisjoint(bm.free_block_ids) and set(held).isdisjoint(bm.evictable)
    assert len(bm.free_block_ids) + len(bm.evictable) + len(set(held)) == bm.num_blocks
    assert all(bm.block_hashes[b] is not None for b in bm.evictable)
    assert all(bm.hash_to_block_id[bm.block_hashes[b]] == b for b in bm.evictable)


def drive(scheduler: Scheduler, seqs: list[Sequence], max_steps: int = 10_000) -> FakeRunner:
    """Runs the sequences to completion the way the engine does, checking invariants each step."""
    bm = scheduler.block_manager
    runner = FakeRunner(bm)
    for seq in seqs:
        scheduler.add(seq)
    for _ in range(max_steps):
        if not scheduler.has_unfinished():
            break
        scheduled = scheduler.schedule()
        assert scheduled, "unfinished requests but nothing scheduled: the scheduler is stuck"
        assert all(s.num_new_tokens >= 1 for s in scheduled)
        assert sum(s.num_new_tokens for s in scheduled) <= scheduler.max_num_batched_tokens
        assert len(scheduler.running) <= scheduler.max_num_seqs
        check_block_accounting(bm, scheduler.running)
        runner.execute(scheduled)
        for s in scheduled:
            seq, completes = s.seq, s.completes_prompt
            seq.num_computed_tokens += s.num_new_tokens
            if completes:
                seq.token_ids.append(runner.next_token(seq))
                if seq.num_output_tokens == seq.params.max_tokens:
                    scheduler.finish(seq, "length")
    assert not scheduler.has_unfinished(), f"not done after {max_steps} steps"
    check_block_accounting(bm, [])
    assert bm.usage == 0.0
    return runner


def workload(seed: int, num_seqs: int) -> list[Sequence]:
    """Prompts drawn from a few shared system prompts plus private suffixes, some repeated."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(5, 40))] for _ in range(3)]
    prompts = []
    for _ in range(num_seqs):
        if prompts and rng.random() < 0.2:
            prompts.append(list(rng.choice(prompts)))
        else:
            suffix = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 20))]
            prompts.append(rng.choice(systems) + suffix)
    return [
        Sequence(p, SamplingParams(max_tokens=rng.randrange(1, 12)), detokenizer=None)
        for p in prompts
    ]


def outputs_of(seqs: list[Sequence]) -> list[list[int]]:
    return [seq.output_token_ids for seq in seqs]


@pytest.mark.parametrize(
    ("num_blocks", "budget", "max_num_seqs"),
    [(200, 64, 16), (20, 64, 16), (18, 7, 4), (30, 1, 64)],
    ids=["roomy", "preempting", "small-budget", "budget-below-seqs"],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_fake_workload_reads_only_its_own_kv(num_blocks, budget, max_num_seqs, seed):
    results = {}
    for caching in (False, True):
        bm = BlockManager(num_blocks, block_size=4, enable_prefix_caching=caching)
        scheduler = Scheduler(bm, max_num_seqs, budget)
        seqs = workload(seed, num_seqs=30)
        runner = drive(scheduler, seqs)
        results[caching] = (outputs_of(seqs), runner.num_tokens_run, bm)
    (plain, plain_run, _), (cached, cached_run, bm) = results[False], results[True]
    assert cached == plain
    assert bm.prefix_cache_hits > 0
    assert bm.prefix_cache_hits <= bm.prefix_cache_queries
    assert cached_run < plain_run  # reuse skipped work


def test_block_table_never_exceeds_what_fits():
    """With exactly enough blocks for one maximal sequence, others wait or are preempted."""
    bm = BlockManager(num_blocks=5, block_size=4)
    seqs = [
        Sequence(list(range(3, 3 + 12)), SamplingParams(max_tokens=8), detokenizer=None)
        for _ in range(3)
    ]
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=32)
    drive(scheduler, seqs)
    assert outputs_of(seqs)[0] == outputs_of(seqs)[1] == outputs_of(seqs)[2]


def test_drafts_take_what_prefill_leaves_and_none_in_a_step_that_prefills():
    """A speculating sequence gets draft slots only in steps that prefill no prompt and from
    the budget the step's known tokens leave: a prompt's chunks, and so the steps that mix them
    with decode rows, are those of plain decoding (tests/test_spec_decode.py checks the
    outputs)."""
    bm = BlockManager(num_blocks=32, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=8)
    drafting = Sequence([5] * 4, SamplingParams(max_tokens=20), detokenizer=None)
    drafting.num_lookahead_tokens = 3
    scheduler.add(drafting)
    (first,) = scheduler.schedule()  # its prompt
    drafting.num_computed_tokens += first.num_new_tokens
    drafting.token_ids.append(7)
    scheduler.add(Sequence([6] * 10, SamplingParams(max_tokens=2), detokenizer=None))
    step = scheduler.schedule()  # its token and 7 of the prompt's 10: no drafts
    assert [(s.num_new_tokens, s.num_lookahead_tokens) for s in step] == [(1, 0), (7, 0)]
    drafting.num_computed_tokens += 1
    drafting.token_ids.append(7)
    step[1].seq.num_computed_tokens += 7
    step = scheduler.schedule()  # the prompt's last 3 tokens still prefill: no drafts
    assert [(s.num_new_tokens, s.num_lookahead_tokens) for s in step] == [(1, 0), (3, 0)]
    drafting.num_computed_tokens += 1
    drafting.token_ids.append(7)
    step[1].seq.num_computed_tokens += 3
    step[1].seq.token_ids.append(7)
    step = scheduler.schedule()  # two decode rows: drafts from the 6 tokens they leave
    assert [(s.num_new_tokens, s.num_lookahead_tokens) for s in step] == [(1, 3), (1, 0)]


def test_scheduler_rejects_a_request_larger_than_the_cache():
    bm = BlockManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    fits = Sequence([5] * 10, SamplingParams(max_tokens=6), detokenizer=None)  # 16 tokens
    too_big = Sequence([5] * 10, SamplingParams(max_tokens=7), detokenizer=None)  # 17 tokens
    scheduler.add(fits)
    with pytest.raises(ValidationError, match="do not fit in the KV cache of 16 tokens"):
        scheduler.add(too_big)
    assert list(scheduler.waiting) == [fits]


def test_preempted_sequence_requeues_first_and_frees_everything():
    bm = BlockManager(num_blocks=8, block_size=4)
    scheduler = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = (Sequence([7] * 9, SamplingParams(max_tokens=4), detokenizer=None) for _ in range(2))
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    a.num_computed_tokens = b.num_computed_tokens = 9
    scheduler.preempt(b)
    assert b.status == SequenceStatus.WAITING and scheduler.waiting[0] is b
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert scheduler.num_preemptions == 1
    check_block_accounting(bm, [a])


# ---- the engine on a tiny llama ----------------------------------------------------------------


@pytest.fixture(scope="module")
def net(tiny_checkpoint):
    return load_model(tiny_checkpoint("llama").path)[0]


def make_engine(net, num_blocks: int | None = None, block_size: int = 4, **config) -> LLMEngine:
    # A new engine gives the model a new KV cache: engines made earlier must not be stepped again.
    per_block = block_size * kv_bytes_per_token(net.attention_layers(), torch.float32)
    kv_bytes = (num_blocks or 512) * per_block
    return LLMEngine(
        net, None, EngineConfig(kv_cache_bytes=kv_bytes, block_size=block_size, **config)
    )


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(
        3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def run(engine: LLMEngine, prompts: list[list[int]], params=GREEDY, ids=None):
    """Adds the prompts, steps until done; returns {request_id: final output}."""
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=ids[i] if ids else None)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return final


def alone(net, p: list[int], params=GREEDY) -> list[int]:
    [out] = run(make_engine(net, enable_prefix_caching=False), [p], params).values()
    return out.token_ids


def test_engine_caps_max_model_len_by_the_cache_and_rejects_at_once(net):
    engine = make_engine(net, num_blocks=10, max_model_len=512)
    assert engine.max_model_len == 40  # 10 blocks of 4 tokens, not the configured 512
    with pytest.raises(ValidationError, match="maximum context length is 40 tokens"):
        engine.add_request(prompt(41, seed=0), SamplingParams(max_tokens=1))
    with pytest.raises(ValidationError, match="45 were requested"):
        engine.add_request(prompt(30, seed=0), SamplingParams(max_tokens=15))
    assert not engine.has_unfinished()
    out = run(engine, [prompt(30, seed=0)], SamplingParams(max_tokens=10, ignore_eos=True))
    assert len(next(iter(out.values())).token_ids) == 10  # exactly the whole cache still works


def test_abort_waiting_and_running_frees_at_once(net):
    engine = make_engine(net, num_blocks=12, max_num_batched_tokens=8)
    bm = engine.block_manager
    for i in range(4):
        engine.add_request(prompt(20, seed=i), GREEDY, request_id=f"r{i}")
    engine.step()  # r0 takes the whole budget: r0 prefilling, r1..r3 waiting
    assert engine.stats()["num_running"] == 1 and engine.stats()["num_waiting"] == 3
    engine.abort("r2")
    assert engine.stats()["num_waiting"] == 2
    engine.abort("r0")
    assert bm.usage == 0.0 and bm.num_free_blocks == 12
    outputs = run(engine, [])
    assert sorted(outputs) == ["r1", "r3"]
    assert outputs["r1"].token_ids == alone(net, prompt(20, seed=1))
    assert bm.usage == 0.0 and engine.stats()["num_running"] == 0


def test_more_running_requests_than_the_token_budget_all_finish(net):
    engine = make_engine(net, max_num_batched_tokens=2)
    prompts = [prompt(5, seed=i) for i in range(5)]
    outputs = run(engine, prompts, ids=[f"r{i}" for i in range(5)])
    assert [outputs[f"r{i}"].token_ids for i in range(5)] == [alone(net, p) for p in prompts]


def test_a_failing_forward_pass_only_fails_its_request(net, monkeypatch):
    engine = make_engine(net)
    execute = engine.runner.execute

    def fragile(scheduled, row_settings=None):
        if any(s.seq.request_id == "bad" for s in scheduled):
            raise RuntimeError("kernel failure")  # before any KV of the step is written
        return execute(scheduled, row_settings)

    monkeypatch.setattr(engine.runner, "execute", fragile)
    p = [prompt(9, seed=1), prompt(14, seed=2), prompt(11, seed=3)]
    outputs = run(engine, p, ids=["a", "bad", "b"])
    assert outputs["bad"].finish_reason == "error" and outputs["bad"].token_ids == []
    assert outputs["a"].token_ids == alone(net, p[0])
    assert outputs["b"].token_ids == alone(net, p[2])
    assert engine.block_manager.usage == 0.0 and not engine.sequences
    # The engine keeps serving, and the failed request's never-written blocks are not reused.
    again = run(engine, [p[1]], ids=["after"])
    assert again["after"].token_ids == alone(net, p[1])


class FragileSampler:
    def __init__(self, sampler, bad_request_id: str) -> None:
        self.sampler, self.bad_request_id = sampler, bad_request_id

    def __call__(self, logits, seqs):
        if any(seq.request_id == self.bad_request_id for seq in seqs):
            raise RuntimeError("probability tensor contains nan")
        return self.sampler(logits, seqs)

    def release(self, seq) -> None:
        self.sampler.release(seq)

    def anomaly(self, seq) -> str | None:
        return self.sampler.anomaly(seq)


def test_a_failing_sampler_or_output_only_fails_its_request(net, monkeypatch):
    engine = make_engine(net)
    append = engine._append

    def fragile_append(seq, token, logprobs):
        if seq.request_id == "bad-output" and seq.num_output_tokens == 2:
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "broken tokenizer")
        return append(seq, token, logprobs)

    monkeypatch.setattr(engine, "sampler", FragileSampler(engine.sampler, "bad-sample"))
    monkeypatch.setattr(engine, "_append", fragile_append)
    p = [prompt(8, seed=s) for s in range(3)]
    outputs = run(engine, p, ids=["bad-sample", "ok", "bad-output"])
    assert outputs["bad-sample"].finish_reason == "error"
    assert outputs["bad-output"].finish_reason == "error"
    assert len(outputs["bad-output"].token_ids) == 2  # failed while adding its third token
    assert outputs["ok"].finish_reason == "length"
    assert outputs["ok"].token_ids == alone(net, p[1])
    assert engine.block_manager.usage == 0.0 and not engine.sequences

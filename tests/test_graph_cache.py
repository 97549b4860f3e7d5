"""Compiled decode steps (the plan cache) against the eager model and transformers.

The oracle is transformers' own greedy generation on the same random llama (and on SmolLM2, the
eager path's logits); compile counts come from GraphCache's backend, which inductor calls once
per graph built. Every test that compiles is slow: inductor takes tens of seconds per graph.
"""

import pytest
import torch
from tiny_models import make_checkpoint

from zcode.config import EngineConfig
from zcode.engine.graph_cache import batch_buckets
from zcode.engine.llm_engine import LLMEngine
from zcode.forward_batch import ForwardBatch
from zcode.harness.plan import ExecutionPlan
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams

NUM_NEW = 20
PROMPT_LENS = (5, 17, 33)  # the 33-token prompt crosses two block boundaries while decoding


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("llama")


@pytest.fixture(scope="module")
def compiled(tiny):
    """An engine with compilation on, shared so that each bucket compiles once per module."""
    net, _ = tiny
    return LLMEngine(net, None, EngineConfig(kv_cache_bytes=1 << 20, compile=True, max_num_seqs=4))


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list]:
    """Greedy tokens per prompt and the logits rows the engine sampled from, by step."""
    params = SamplingParams(max_tokens=NUM_NEW, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    logits_by_step = []
    execute = engine.runner.execute

    def recording(scheduled, row_settings=None):
        logits = execute(scheduled, row_settings)
        logits_by_step.append([row[-1].clone() for row in logits])
        return logits

    engine.runner.execute = recording
    try:
        while engine.has_unfinished():
            engine.step()
    finally:
        engine.runner.execute = execute
    return [s.output_token_ids for s in seqs], logits_by_step


def _oracle_tokens(oracle, prompt: list[int]) -> list[int]:
    with torch.no_grad():
        out = oracle.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=NUM_NEW,
            min_new_tokens=NUM_NEW,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def test_buckets_cover_max_num_seqs():
    assert batch_buckets(1) == [1]
    assert batch_buckets(5) == [1, 2, 4, 8]
    assert batch_buckets(64)[-1] == 64


def test_decode_batch_pads_rows_and_context():
    # Two sequences of 5 and 18 tokens in blocks of 4, padded to a bucket of 4 rows.
    batch = ForwardBatch.build_decode([5, 18], [[7, 3], [0, 1, 2, 5, 6]], 4, 4, pad_block=9)
    assert batch.context_slots.shape == (4, 20)
    assert batch.positions.tolist() == [4, 17, 0, 0]
    # token 4 of sequence 0 lives in block 3 at offset 0; token 17 of sequence 1 in block 6, 1
    assert batch.slot_mapping.tolist() == [12, 25, 36, 36]
    assert batch.context_slots[0, :5].tolist() == [28, 29, 30, 31, 12]
    assert batch.attn_mask[:, 0, 0].sum(-1).tolist() == [5, 18, 1, 1]
    assert (batch.context_slots[2:] // 4 == 9).all()


def test_verifying_batch_pads_each_row_to_the_width():
    """Rows of 1 and 3 query tokens (a token and its drafts) in a width of 4, padded to 4 rows:
    every real token has the position, slot and visible context the eager batch gives it;
    padding tokens sit at position 0, write the pad block and see position 0 only."""
    lens, tables, q_lens = [5, 18], [[7, 3], [0, 1, 2, 5, 6]], [1, 3]
    batch = ForwardBatch.build_decode(lens, tables, 4, 4, 9, query_lens=q_lens, query_width=4)
    eager = ForwardBatch.build(q_lens, lens, tables, 4, num_logits=q_lens)
    real = [0, 4, 5, 6]  # row 0 token 0, row 1 tokens 0-2
    assert batch.positions[real].tolist() == eager.positions.tolist()
    assert batch.slot_mapping[real].tolist() == eager.slot_mapping.tolist()
    visible = batch.attn_mask[:, 0].reshape(16, -1)  # [B * S, L]
    for t, (b, s) in zip(real, [(0, 0), (1, 0), (1, 1), (1, 2)]):
        seen = eager.context_slots[b][eager.attn_mask[b, 0, s]]
        assert batch.context_slots[b][visible[t]].tolist() == seen.tolist()
    padding = sorted(set(range(16)) - set(real))
    assert batch.positions[padding].eq(0).all() and batch.slot_mapping[padding].eq(36).all()
    assert visible[padding].sum(-1).eq(1).all() and visible[padding, 0].all()
    assert batch.logits_index.tolist() == list(range(16))


@pytest.mark.slow
def test_compiled_decode_matches_eager_and_transformers(tiny, compiled):
    net, oracle = tiny
    eager = LLMEngine(net, None, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4))
    eager_tokens, eager_logits = _generate(eager, _prompts())
    compiles_before = compiled.stats()["num_graph_compiles"]
    tokens, logits = _generate(compiled, _prompts())
    assert compiled.stats()["num_graph_compiles"] > compiles_before  # the graph really ran
    assert compiled.runner.graphs.direct  # later steps called it without dynamo
    assert tokens == eager_tokens
    assert tokens == [_oracle_tokens(oracle, p) for p in _prompts()]
    for step_eager, step_compiled in zip(eager_logits, logits, strict=True):
        for a, b in zip(step_eager, step_compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_second_request_with_same_plan_does_not_recompile(compiled):
    prompts = _prompts()
    _generate(compiled, prompts)  # compiles whatever this batch shape needs
    before = compiled.stats()["num_graph_compiles"]
    # Same plan and bucket, other prompts and lengths: the cached graphs serve every step.
    tokens, _ = _generate(compiled, [p[::-1] + p for p in prompts])
    assert compiled.stats()["num_graph_compiles"] == before
    assert all(len(t) == NUM_NEW for t in tokens)


@pytest.mark.slow
def test_new_plan_signature_compiles_its_own_graph(compiled):
    runner = compiled.runner
    _generate(compiled, _prompts()[:1])
    before = compiled.stats()["num_graph_compiles"]
    try:
        # Same modules, so the same result; a distinct signature must get a graph of its own.
        runner.set_plan(ExecutionPlan(extras=(("test", "other-signature"),)))
        _generate(compiled, _prompts()[:1])
        assert compiled.stats()["num_graph_compiles"] == before + 1
    finally:
        runner.set_plan(ExecutionPlan())


@pytest.mark.slow
def test_direct_steps_read_tensors_swapped_before_set_plan(tiny, compiled):
    """A direct (dynamo-free) step holds the model's tensors; set_plan makes it re-read them,
    and a KV cache replaced by another engine on the same model is noticed by itself."""
    net, _ = tiny
    _generate(compiled, _prompts())  # every key this batch needs is compiled and direct
    mlp = net.model.layers[0].mlp
    original = mlp.down_proj.weight
    eager = LLMEngine(net, None, EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4))
    try:
        mlp.down_proj.weight = torch.nn.Parameter(original * -3.0, requires_grad=False)
        compiled.runner.set_plan(ExecutionPlan())  # same signature: the same graphs serve
        before = compiled.stats()["num_graph_compiles"]
        # Prompts no test used: a cached prefix would hold KV computed with the old weight.
        prompts = [[(7 * t) % 250 + 3 for t in p] for p in _prompts()]
        tokens, logits = _generate(compiled, prompts)
        eager_tokens, eager_logits = _generate(eager, prompts)
    finally:
        mlp.down_proj.weight = original
        compiled.runner.set_plan(ExecutionPlan())
    assert compiled.stats()["num_graph_compiles"] == before
    assert tokens == eager_tokens
    for step_eager, step_compiled in zip(eager_logits, logits, strict=True):
        for a, b in zip(step_eager, step_compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_a_model_tensor_of_another_shape_recompiles(tmp_path):
    """Compiled graphs carry no size asserts: a tensor that changed shape (here the KV cache,
    replaced by a larger engine's on the same model) must send the step back through dynamo's
    guards and a recompile, not into a graph built for the old shape."""
    make_checkpoint("llama", tmp_path)
    net, _ = load_model(tmp_path)  # its own model: the engines below replace its KV cache
    config = EngineConfig(kv_cache_bytes=1 << 20, compile=True, max_num_seqs=1)
    engine = LLMEngine(net, None, config)
    _generate(engine, _prompts()[:1])  # compiles bucket 1; later steps are direct
    before = engine.stats()["num_graph_compiles"]
    larger = LLMEngine(net, None, EngineConfig(kv_cache_bytes=2 << 20, max_num_seqs=1))
    prompts = [[(11 * t) % 250 + 3 for t in _prompts()[1]]]  # nothing cached
    tokens, logits = _generate(engine, prompts)
    eager_tokens, eager_logits = _generate(larger, prompts)
    assert engine.stats()["num_graph_compiles"] == before + 1
    assert tokens == eager_tokens
    for step_eager, step_compiled in zip(eager_logits, logits, strict=True):
        for a, b in zip(step_eager, step_compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_smollm2_compiled_decode_matches_eager():
    from zcode import LLM

    prompts = ["The capital of France is", "def fibonacci(n):"]
    llms = {
        # float32: eager and compiled are compared at atol 1e-4; int8 activation codes (the
        # file's Q4_1 run as stored) turn fp32 rounding differences into near-tie flips.
        compile: LLM(None, dtype="float32", kv_cache_bytes=16 << 20, compile=compile)
        for compile in (False, True)
    }
    tokens, logits = {}, {}
    for compile, llm in llms.items():
        ids = [llm.encode(p) for p in prompts]
        tokens[compile], logits[compile] = _generate(llm.engine, ids)
    assert tokens[True] == tokens[False]
    for step_eager, step_compiled in zip(logits[False], logits[True], strict=True):
        for a, b in zip(step_eager, step_compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)
    engine = llms[True].engine
    before = engine.stats()["num_graph_compiles"]
    assert before >= 1
    _generate(engine, [llms[True].encode("Once upon a time"), llms[True].encode("Q: 2+2?")])
    assert engine.stats()["num_graph_compiles"] == before


@pytest.mark.slow
def test_quantized_plan_compiles_and_matches_eager(tiny_checkpoint):
    """A plan with QuantizedLinear modules compiles (autotuning stays out of the graph) and
    decodes as the eager engine does with the same plan."""
    from zcode.quant import apply_precision, quantizable_modules

    path = tiny_checkpoint("llama").path
    engines = []
    for compile in (False, True):
        net, _ = load_model(path)
        plan = {name: "int4-g32" for name in quantizable_modules(net)}
        apply_precision(net, plan)
        config = EngineConfig(kv_cache_bytes=1 << 20, compile=compile, max_num_seqs=4)
        engine = LLMEngine(net, None, config)
        engine.runner.set_plan(ExecutionPlan(precision=tuple(sorted(plan.items()))))
        engines.append(engine)
    eager, compiled = engines
    eager_tokens, eager_logits = _generate(eager, _prompts())
    tokens, logits = _generate(compiled, _prompts())
    assert compiled.stats()["num_graph_compiles"] > 0  # the graph really ran
    assert tokens == eager_tokens
    for step_eager, step_compiled in zip(eager_logits, logits, strict=True):
        for a, b in zip(step_eager, step_compiled, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=2e-2)  # bf16 activations in both


@pytest.mark.slow
def test_a_compiled_server_answers_as_an_eager_one(tiny_checkpoint):
    """`zcode serve --compile`: concurrent completions, stepped by the server's engine thread,
    run compiled decode steps (graphs built, later steps called without dynamo) and give the
    eager server's tokens."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    from remote_server import InThreadServer

    from zcode.server.app import build_app
    from zcode.server.launch import build_state

    path = str(tiny_checkpoint("llama").path)
    states = [
        build_state(path, "tiny", {"dtype": "float32", "kv_cache_bytes": 1 << 20, **extra})
        for extra in ({"compile": True}, {})
    ]
    served = [InThreadServer(build_app(state)) for state in states]
    try:

        def complete(server, prompt: list[int]) -> list[int]:
            client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
            got = client.completions.create(
                model="tiny", prompt=prompt, max_tokens=8, temperature=0, logprobs=0
            )
            return [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens]

        prompts = _prompts()
        with ThreadPoolExecutor(len(prompts)) as pool:
            compiled = list(pool.map(lambda p: complete(served[0], p), prompts))
        assert compiled == [complete(served[1], p) for p in prompts]
        runner = states[0].llm.engine.runner
        assert runner.num_graph_compiles > 0 and runner.graphs.direct
        assert states[1].llm.engine.runner.graphs is None
    finally:
        for server in served:
            server.stop()

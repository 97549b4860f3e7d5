"""Per-request layer skipping (EngineConfig.per_request_depth): a request that skips decoder
layers runs as transformers' model without them, keeps no KV pages for them, and batches with
requests that skip other layers or none.

Oracle: transformers' model with the skipped layers removed from its ModuleList, as for the
engine-wide skip plans in test_sparsity.
"""

import copy

import pytest
import torch
from test_engine import GREEDY, PieceTokenizer, _prompt, _run
from tiny_models import make_checkpoint

from zcode.config import EngineConfig
from zcode.engine.block_manager import BlockManager
from zcode.engine.llm_engine import LLMEngine
from zcode.engine.page_pool import PagePool
from zcode.engine.sequence import Sequence
from zcode.errors import ValidationError
from zcode.loader import load_model
from zcode.sampling_params import SamplingParams

LOGPROBS = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module", params=["llama", "glm4_moe"])
def tiny(request, tiny_model):
    """(our model, transformers' model) sharing the same random weights."""
    return tiny_model(request.param)


def _engine(net, **config) -> LLMEngine:
    config.setdefault("kv_cache_bytes", 1 << 20)
    return LLMEngine(net, PieceTokenizer(), EngineConfig(per_request_depth=True, **config))


def _without_layers(oracle, skip: set[int], skip_heads: set[tuple[int, int]] = frozenset()):
    """transformers' model without the skipped layers, and with the skipped KV heads' o_proj
    columns zeroed (which removes exactly what those heads add)."""
    model = copy.deepcopy(oracle)
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    width = c.num_attention_heads // c.num_key_value_heads * head_dim
    with torch.no_grad():
        for i, g in skip_heads:
            model.model.layers[i].self_attn.o_proj.weight[:, g * width : (g + 1) * width] = 0
    model.model.layers = torch.nn.ModuleList(
        [layer for i, layer in enumerate(model.model.layers) if i not in skip]
    )
    model.config.num_hidden_layers = len(model.model.layers)
    return model.eval()


def _assert_matches(oracle, out) -> None:
    """Every sampled token is the oracle's argmax, with the oracle's log-probability."""
    tokens = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        logits = oracle(torch.tensor([tokens]), use_cache=False).logits[0].double()
    expected = torch.log_softmax(logits, dim=-1)[len(out.prompt_token_ids) - 1 : -1]
    assert out.token_ids == expected.argmax(-1).tolist()
    for row, token, entry in zip(expected, out.token_ids, out.logprobs, strict=True):
        assert entry[token] == pytest.approx(float(row[token]), abs=1e-4)


def test_requests_skipping_different_layers_and_heads_in_one_batch_match_their_oracles(tiny):
    """Five requests in every step together (a short step budget mixes chunked prefill with
    decode): one dense, the others skipping different layers and KV heads; each equals its own
    oracle."""
    net, oracle = tiny
    num_layers = len(net.model.layers)
    skips = [
        (set(), set()),
        ({1}, set()),
        ({0, num_layers - 1} if num_layers > 2 else {0}, set()),
        (set(), {(0, 1), (1, 0)}),
        ({0}, {(1, 1)}),
    ]
    prompts = [_prompt(11 + 2 * i, seed=20 + i) for i in range(len(skips))]
    engine = _engine(net, max_num_batched_tokens=12, block_size=4)
    seqs = [
        engine.add_request(p, LOGPROBS, skip_layers=layers, skip_kv_heads=heads)
        for p, (layers, heads) in zip(prompts, skips, strict=True)
    ]
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    for seq, (layers, heads) in zip(seqs, skips, strict=True):
        _assert_matches(_without_layers(oracle, layers, heads), finished[seq.request_id])


def test_skipped_layers_and_heads_hold_no_pages(tiny):
    net, _ = tiny
    engine = _engine(net, block_size=4)
    pages = engine.block_manager.pages
    heads = pages.heads_per_layer
    free = pages.num_free_pages
    dense = engine.add_request(_prompt(10, seed=23), GREEDY)
    no_layer = engine.add_request(_prompt(10, seed=24), GREEDY, skip_layers=[1])
    no_head = engine.add_request(_prompt(10, seed=31), GREEDY, skip_kv_heads=[(0, 1)])
    engine.step()  # the prompts prefilled: 3 blocks each
    assert [len(s.block_table) for s in (dense, no_layer, no_head)] == [3, 3, 3]
    used = 3 * sum(heads) + 3 * (sum(heads) - heads[1]) + 3 * (sum(heads) - 1)
    assert free - pages.num_free_pages == used
    layer1 = range(pages.first_unit[1], pages.first_unit[1] + heads[1])
    assert all(pages.table[u, b] == 0 for u in layer1 for b in no_layer.block_table)
    assert all(pages.table[u, b] > 0 for u in layer1 for b in dense.block_table)
    assert all(pages.table[1, b] == 0 for b in no_head.block_table)  # unit 1: layer 0, head 1
    assert all(pages.table[0, b] > 0 for b in no_head.block_table)


def test_skipping_layers_fits_more_tokens_in_the_same_memory(tiny):
    """A cache of 8 dense blocks (of 4 tokens) takes a 40-token request once it skips half the
    layers of a 2-layer model, or a third of a 3-layer one, and refuses it dense."""
    net, oracle = tiny
    num_layers = len(net.model.layers)
    dense_engine = _engine(net, block_size=4)
    bytes_per_block = 4 * dense_engine.runner.kv_cache.bytes_per_token
    engine = _engine(net, block_size=4, kv_cache_bytes=8 * bytes_per_block)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    prompt = _prompt(36, seed=25)
    with pytest.raises(ValidationError, match="do not fit in the KV cache of 32 tokens"):
        engine.add_request(prompt, params)
    [out], _ = _run_skipping(engine, prompt, params, {num_layers - 1})
    _assert_matches(_without_layers(oracle, {num_layers - 1}), out)


def _run_skipping(engine, prompt, params, skip):
    seq = engine.add_request(prompt, params, skip_layers=skip)
    finished = {}
    while engine.has_unfinished():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    return [finished[seq.request_id]], seq


def test_prefix_cache_is_shared_only_by_requests_skipping_the_same_layers(tiny):
    net, _ = tiny
    engine = _engine(net, block_size=4)
    prompt = _prompt(17, seed=26)
    bm = engine.block_manager
    _run(engine, [prompt], GREEDY)  # dense: publishes 4 blocks
    hits = bm.prefix_cache_hits
    _run_skipping(engine, prompt, GREEDY, {1})
    assert bm.prefix_cache_hits == hits  # dense KV is not this request's KV
    _run_skipping(engine, prompt, GREEDY, {1})
    assert bm.prefix_cache_hits == hits + 16


def test_evicted_cached_blocks_give_back_their_pages():
    """Two layers, pages for 4 dense blocks: cached blocks of finished requests are evicted for
    the pages a new request needs, and every page comes back."""
    pool = PagePool(heads_per_layer=[1, 1], num_pages=9, num_blocks=8)
    bm = BlockManager(8, block_size=2, pages=pool)
    params = SamplingParams(max_tokens=1)
    first = Sequence(list(range(8)), params, None)  # 4 blocks, all layers: every page
    bm.allocate(first, 8)
    first.num_computed_tokens = 8
    bm.free(first)  # 4 cached blocks, 8 pages
    assert pool.num_free_pages == 0 and bm.evictable_pages == 8 and bm.usage == 0.0
    second = Sequence(list(range(100, 112)), params, None, skip_layers=frozenset({0}))
    assert bm.can_allocate(second, 12)  # 6 blocks of one page each
    bm.allocate(second, 12)
    assert bm.evictable_pages == 2 and len(bm.evictable) == 1  # 3 of the 4 were evicted
    assert bm.usage == pytest.approx(6 / 8)
    third = Sequence(list(range(200, 206)), params, None)
    assert not bm.can_allocate(third, 6)  # 3 blocks of 2 pages; 2 pages left
    assert all(pool.table[0, b] == 0 for b in second.block_table)  # no pages in layer 0
    second.num_computed_tokens = 12
    bm.free(second)
    assert pool.num_free_pages + bm.evictable_pages == 8


@pytest.mark.parametrize(
    "skips, match",
    [
        ({"skip_layers": [7]}, "out of range"),
        ({"skip_layers": [-1]}, "out of range"),
        ({"skip_layers": [True]}, "out of range"),
        ({"skip_layers": "1"}, "not a string"),
        ({"skip_kv_heads": [(0, 2)]}, "names no"),
        ({"skip_kv_heads": [(9, 0)]}, "names no"),
        ({"skip_kv_heads": [(0, 0, 1)]}, "names no"),
        ({"skip_kv_heads": [3]}, "pairs"),
        ({"skip_kv_heads": "00"}, "not a string"),
        ("every layer", "must keep one"),
        ("every head", "must keep one"),
    ],
)
def test_bad_skips_are_refused(tiny, skips, match):
    net, _ = tiny
    engine = _engine(net)
    num_layers = len(net.model.layers)
    if skips == "every layer":
        skips = {"skip_layers": range(num_layers)}
    elif skips == "every head":
        skips = {"skip_layers": range(1, num_layers), "skip_kv_heads": [(0, 0), (0, 1)]}
    with pytest.raises(ValidationError, match=match):
        engine.add_request(_prompt(5, seed=27), GREEDY, **skips)
    assert not engine.has_unfinished()


def test_skips_need_per_request_depth(tiny):
    engine = LLMEngine(tiny[0], PieceTokenizer(), EngineConfig(kv_cache_bytes=1 << 20))
    with pytest.raises(ValidationError, match="per_request_depth"):
        engine.add_request(_prompt(5, seed=28), GREEDY, skip_layers=[1])
    with pytest.raises(ValidationError, match="per_request_depth"):
        engine.add_request(_prompt(5, seed=28), GREEDY, skip_kv_heads=[(0, 1)])


def test_what_per_request_depth_does_not_do_yet(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsa")
    make_checkpoint("glm_moe_dsa", path)
    net, _ = load_model(path)
    with pytest.raises(NotImplementedError, match="shared index selections"):
        _engine(net)


@pytest.mark.slow
def test_compiled_steps_give_the_eager_tokens_one_graph_per_plan(tmp_path_factory):
    """Oracle: the eager engine (itself checked against transformers above). A batch whose
    requests share a plan decodes in that plan's graph; a mixed batch steps eagerly."""
    path = tmp_path_factory.mktemp("llama_compiled")
    make_checkpoint("llama", path)
    net, _ = load_model(path)
    batches = [
        [{}],
        [{"skip_layers": [1]}],
        [{"skip_kv_heads": [(0, 1)]}] * 2,
        [{}, {"skip_layers": [0]}],
    ]

    def run(engine, batch):
        seqs = [
            engine.add_request(_prompt(9 + i, seed=40 + i), GREEDY, **s)
            for i, s in enumerate(batch)
        ]
        while engine.has_unfinished():
            engine.step()
        return [s.output_token_ids for s in seqs]

    eager, compiled = _engine(net), _engine(net, compile=True)
    for batch in batches:
        assert run(compiled, batch) == run(eager, batch)
    assert compiled.runner.num_graph_compiles == 3  # the mixed batch compiled nothing
    assert len(compiled.runner.graphs.direct) == 3  # and each plan's steps run without dynamo


def test_the_server_skip_layers_field(tiny_checkpoint):
    """Completions with `skip_layers` or `skip_kv_heads` (served --per-request-depth) give the
    oracle's tokens without those layers or heads; a bad value is a 400 naming the field, and a
    server without pages refuses the field."""
    import openai
    from remote_server import InThreadServer

    from zcode.server.app import build_app
    from zcode.server.launch import build_state

    ckpt = tiny_checkpoint("llama")
    prompt = _prompt(9, seed=29)
    served = [
        InThreadServer(build_app(build_state(str(ckpt.path), "tiny", config)))
        for config in ({"per_request_depth": True}, {})
    ]
    try:
        paged, plain = (
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0) for s in served
        )

        def complete(client, **extra):
            got = client.completions.create(
                model="tiny",
                prompt=prompt,
                max_tokens=5,
                temperature=0,
                logprobs=0,
                extra_body=extra,
            )
            return [int(t.removeprefix("token_id:")) for t in got.choices[0].logprobs.tokens]

        for layers, heads in (({1}, set()), (set(), {(0, 1)})):
            skips = {"skip_layers": sorted(layers), "skip_kv_heads": sorted(heads)}
            oracle = _without_layers(ckpt.oracle, layers, heads)
            with torch.no_grad():
                want = oracle.generate(
                    torch.tensor([prompt]), max_new_tokens=5, do_sample=False, use_cache=False
                )[0, len(prompt) :].tolist()
            assert complete(paged, **skips) == want
        assert complete(paged) == complete(plain)  # no field: the dense model
        for client, bad, match in (
            (paged, [5], "out of range"),
            (paged, ["1"], "skip_layers"),
            (plain, [1], "per_request_depth"),
        ):
            with pytest.raises(openai.BadRequestError, match=match):
                complete(client, skip_layers=bad)
        for bad, match in (([[0, 5]], "names no"), ([[0]], "skip_kv_heads"), ([1], "skip_kv")):
            with pytest.raises(openai.BadRequestError, match=match):
                complete(paged, skip_kv_heads=bad)
    finally:
        for s in served:
            s.stop()


def test_generate_skip_layers_is_all_or_none(tiny_checkpoint):
    from zcode.llm import LLM

    llm = LLM(tiny_checkpoint("llama").path, per_request_depth=True, kv_cache_bytes=1 << 20)
    with pytest.raises(ValidationError, match="out of vocabulary"):
        llm.generate([_prompt(5, seed=30), [10**6]], GREEDY, skip_layers=[1])
    assert not llm.engine.has_unfinished()
    with pytest.raises(ValidationError, match="out of range"):
        llm.generate(_prompt(5, seed=30), GREEDY, skip_layers=[9], max_quality_loss=5.0)
    assert not llm.engine.has_unfinished()
    [out] = llm.generate(_prompt(5, seed=30), GREEDY, skip_layers=[1])
    assert len(out.token_ids) == GREEDY.max_tokens

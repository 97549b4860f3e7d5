"""A decoder layer's halves as one C++ call each at a GGUF model's decode step
(zcode/layers/decode_blocks.py) against the modules they replace: the modules are the oracle
(themselves held to transformers and llama.cpp by test_parity and test_gguf_loader).

F32 and F16 weights multiply fp32 activations, so the two paths differ only in the order of a
few float sums (tight tolerance); the quantized types quantize the normed activations to int8
per block, where an ulp of difference may move a code by one (a looser one, still far below
what a wrong rotation, slot, bias or norm gives).
"""

import copy
import types

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_graph_cache import NUM_NEW, _generate, _prompts
from transformers import Glm4MoeConfig

from zcode.config import EngineConfig
from zcode.engine.llm_engine import LLMEngine
from zcode.forward_batch import ForwardBatch
from zcode.layers import decode_blocks
from zcode.layers.attention import Attention
from zcode.layers.mlp import GatedMLP, GeluGatedMLP
from zcode.layers.moe import MoE
from zcode.layers.norm import RMSNorm
from zcode.layers.rotary import RotaryEmbedding
from zcode.quant.gguf import GgufWeight, ggml_available, interleaving_pays
from zcode.quant.linear import QuantizedLinear

pytestmark = pytest.mark.skipif(not ggml_available(), reason="the GGUF kernels do not build here")

# widths of 256 multiples: the K-quants' blocks
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 256, 8, 2, 32, 512
BLOCK_SIZE = 16
# max |fused - modules| / max |modules|
TOLERANCE = {Q.F32: 1e-5, Q.F16: 1e-5, Q.Q8_0: 2e-3, Q.Q4_0: 2e-3, Q.Q4_K: 2e-3}


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _gguf(linear: torch.nn.Linear, ggml_type: int, seed: int) -> QuantizedLinear:
    g = torch.Generator().manual_seed(seed)
    packed = GgufWeight.random(ggml_type, linear.out_features, linear.in_features, g)
    if interleaving_pays(ggml_type, linear.out_features):
        packed = packed.interleaved_copy()
    return QuantizedLinear(packed, linear.bias, "gguf")


def _attention(
    ggml_type: int,
    bias: bool = False,
    interleaved: bool = False,
    window=None,
    qk_norm=False,
    unit_offset=False,
):
    attn = Attention(
        HIDDEN,
        HEADS,
        KV_HEADS,
        HEAD_DIM,
        interleaved_rope=interleaved,
        qkv_bias=bias,
        qk_norm_eps=1e-6 if qk_norm else None,
        qk_norm_unit_offset=unit_offset,
        sliding_window=window,
    )
    if qk_norm:
        for norm in (attn.q_norm, attn.k_norm):
            _init_norm(norm)
    for i, name in enumerate(("q_proj", "k_proj", "v_proj", "o_proj")):
        linear = getattr(attn, name)
        if linear.bias is not None:
            torch.nn.init.normal_(linear.bias, std=0.5)
        setattr(attn, name, _gguf(linear, ggml_type, seed=i))
    return attn


def _norm(eps: float = 1e-5, unit_offset: bool = False) -> RMSNorm:
    return _init_norm(RMSNorm(HIDDEN, eps, unit_offset=unit_offset))


def _init_norm(norm: RMSNorm) -> RMSNorm:
    """Weights of 0.5-1.5 as the norm applies them (Gemma's: an offset from 1)."""
    torch.nn.init.uniform_(norm.weight, 0.5, 1.5)
    if norm.unit_offset:
        norm.weight.data -= 1
    return norm


def _rope(rotary_dim: int) -> RotaryEmbedding:
    return RotaryEmbedding(types.SimpleNamespace(rope_theta=10000.0), rotary_dim)


def _decode_batch(context_lens: list[int]) -> ForwardBatch:
    """One new token per sequence after context_lens[b] - 1 cached positions, blocks
    interleaved across sequences (slots not in sequence order)."""
    tables = [[b + len(context_lens) * i for i in range(4)] for b in range(len(context_lens))]
    return ForwardBatch.build([1] * len(context_lens), context_lens, tables, BLOCK_SIZE)


def _both(attn: Attention, norm: RMSNorm, x, batch, rope, cache: torch.Tensor, post_norm=None):
    """(modules' output, their cache), (fused output, its cache) from the same cache."""
    attn.cache["kv"] = cache.clone()
    out = attn(norm(x), batch, rope)
    want = x + (out if post_norm is None else post_norm(out))
    want_cache = attn.cache["kv"]
    attn.cache["kv"] = cache.clone()
    got = decode_blocks.attention_residual(attn, norm, x, batch, rope, post_norm)
    assert got is not None, "the half did not take the op"
    return (want, want_cache), (got, attn.cache["kv"])


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    error = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
    assert error <= tolerance, f"max error {error:.2e} of the largest output, over {tolerance}"


CASES = [  # ggml type, qkv bias, interleaved rope, rotary dim, cache dtype, window, norms
    (Q.F32, False, False, HEAD_DIM, torch.float32, None, ""),
    (Q.F16, True, True, HEAD_DIM // 2, torch.float32, None, "post"),  # GLM-4
    (Q.F32, False, False, HEAD_DIM // 2, torch.float16, 5, "qk"),
    (Q.F32, True, False, HEAD_DIM // 2, torch.float32, None, "qk+post"),
    (Q.Q8_0, True, False, HEAD_DIM, torch.bfloat16, None, ""),
    (Q.Q4_0, False, True, HEAD_DIM, torch.float32, None, "qk"),
    (Q.Q4_K, False, False, HEAD_DIM, torch.float32, None, ""),
    (Q.F32, False, False, HEAD_DIM, torch.float32, 5, "qk+post+offset"),  # Gemma 3
]


@pytest.mark.parametrize(
    ("ggml_type", "bias", "interleaved", "rotary_dim", "cache_dtype", "window", "norms"), CASES
)
def test_attention_half_matches_the_modules(
    ggml_type, bias, interleaved, rotary_dim, cache_dtype, window, norms
):
    torch.manual_seed(0)
    offset = "offset" in norms
    attn = _attention(ggml_type, bias, interleaved, window, "qk" in norms, offset)
    norm, batch = _norm(unit_offset=offset), _decode_batch([9, 23, 1])
    post_norm = _norm(unit_offset=offset) if "post" in norms else None
    x = torch.randn(3, HIDDEN) * 2
    rope = _rope(rotary_dim)(batch.positions)
    cache = (torch.randn(12, BLOCK_SIZE, 2, KV_HEADS, HEAD_DIM) * 0.5).to(cache_dtype)
    (want, want_cache), (got, got_cache) = _both(attn, norm, x, batch, rope, cache, post_norm)
    _close(got, want, TOLERANCE[ggml_type])
    written = batch.slot_mapping
    flat = got_cache.view(-1, 2, KV_HEADS, HEAD_DIM)
    _close(flat[written], want_cache.view_as(flat)[written], TOLERANCE[ggml_type])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(flat[untouched], cache.view_as(flat)[untouched])


@pytest.mark.parametrize("ggml_type", [Q.F32, Q.Q8_0, Q.Q4_0, Q.Q4_K])
@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("kind", ["swiglu", "swiglu+post", "gemma"])
def test_mlp_half_matches_the_modules(ggml_type, rows, kind):
    torch.manual_seed(1)
    gemma = kind == "gemma"  # GeGLU, post-norm, norms of offsets from 1
    mlp = (GeluGatedMLP if gemma else GatedMLP)(HIDDEN, INTERMEDIATE)
    for i, name in enumerate(("gate_proj", "up_proj", "down_proj")):
        setattr(mlp, name, _gguf(getattr(mlp, name), ggml_type, seed=10 + i))
    norm, x = _norm(unit_offset=gemma), torch.randn(rows, HIDDEN) * 2
    post_norm = _norm(unit_offset=gemma) if kind != "swiglu" else None
    got = decode_blocks.mlp_residual(mlp, norm, x, post_norm)
    assert got is not None, "the half did not take the op"
    out = mlp(norm(x))
    _close(got, x + (out if post_norm is None else post_norm(out)), TOLERANCE[ggml_type])


@pytest.mark.parametrize("ggml_type", [Q.F32, Q.Q4_0])
@pytest.mark.parametrize(("groups", "kept", "normalize"), [(1, 1, True), (4, 2, False)])
@pytest.mark.parametrize("rows", [1, 5])
def test_moe_half_routes_and_runs_as_the_modules(ggml_type, groups, kept, normalize, rows):
    torch.manual_seed(2)
    config = Glm4MoeConfig(
        hidden_size=HIDDEN,
        moe_intermediate_size=64,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=groups,
        topk_group=kept,
        norm_topk_prob=normalize,
        routed_scaling_factor=2.5,
    )
    moe = MoE(config)
    torch.nn.init.normal_(moe.gate.weight, std=HIDDEN**-0.5)
    moe.gate.e_score_correction_bias.normal_(std=0.3)
    for i, mlp in enumerate((*moe.experts, moe.shared_experts)):
        for j, name in enumerate(("gate_proj", "up_proj", "down_proj")):
            setattr(mlp, name, _gguf(getattr(mlp, name), ggml_type, seed=100 + 3 * i + j))
    norm, x = _norm(), torch.randn(rows, HIDDEN) * 2
    got = decode_blocks.mlp_residual(moe, norm, x)
    assert got is not None, "the half did not take the op"
    _close(got, x + moe(norm(x)), TOLERANCE[ggml_type])
    moe.experts_per_token = 2  # a plan's expert limit: the modules'
    assert decode_blocks.mlp_residual(moe, norm, x) is None


def test_what_the_op_does_not_cover_runs_the_modules():
    attn, norm, batch = _attention(Q.F32), _norm(), _decode_batch([4, 7])
    attn.cache["kv"] = torch.zeros(12, BLOCK_SIZE, 2, KV_HEADS, HEAD_DIM)
    x, rope = torch.randn(2, HIDDEN), _rope(HEAD_DIM)(batch.positions)
    assert decode_blocks.attention_residual(attn, norm, x, batch, rope) is not None
    # a prefill (several tokens of one sequence), bf16 activations
    prefill = ForwardBatch.build([3], [3], [[0]], BLOCK_SIZE)
    prefill_rope = _rope(HEAD_DIM)(prefill.positions)
    x3 = torch.randn(3, HIDDEN)
    assert decode_blocks.attention_residual(attn, norm, x3, prefill, prefill_rope) is None
    assert decode_blocks.attention_residual(attn, norm, x.bfloat16(), batch, rope) is None
    # a hook (calibration's) sees its module's call
    handle = attn.o_proj.register_forward_hook(lambda *args: None)
    assert decode_blocks.attention_residual(attn, norm, x, batch, rope) is None
    handle.remove()
    assert decode_blocks.attention_residual(attn, norm, x, batch, rope) is not None
    # a post-norm of another eps than the input norm's (the op takes one)
    assert decode_blocks.attention_residual(attn, norm, x, batch, rope, _norm(1e-6)) is None
    # the reference kernel asked for, a module swapped for a float one
    attn.v_proj.kernel = "reference"
    assert decode_blocks.attention_residual(attn, norm, x, batch, rope) is None
    attn.v_proj.kernel = "fast"
    attn.k_proj = torch.nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=False)
    assert decode_blocks.attention_residual(attn, norm, x, batch, rope) is None


def _as_gguf_f32(net: torch.nn.Module) -> torch.nn.Module:
    """net's attention, MLP and expert linears as GGUF F32 rows (its own weights): what a
    converted F32 file loads as; the activations are not quantized, so both paths agree to float
    rounding."""
    for layer in net.model.layers:
        for half in (layer.self_attn, layer.mlp):
            for module in list(half.modules()):
                for name, linear in list(module.named_children()):
                    if isinstance(linear, torch.nn.Linear):
                        rows = linear.weight.detach().float().contiguous().view(torch.uint8)
                        packed = GgufWeight(rows, Q.F32, linear.in_features)
                        setattr(module, name, QuantizedLinear(packed, linear.bias, "gguf"))
    return net


def _run(net, mode: str, compile: bool = False):
    """Greedy tokens and the logits rows of every step (test_graph_cache's _generate) with
    `mode`: "modules" (no op), "halves" (each half's op, layer by layer) or "stack" (every layer
    in one call where it can, else the halves); the calls that took an op counted."""
    names = ("attention_residual", "mlp_residual", "stack_residual")
    runs = {"modules": (), "halves": names[:2], "stack": names}[mode]
    originals = {name: getattr(decode_blocks, name) for name in names}
    calls = dict.fromkeys(names, 0)

    def counted(name, fn):
        def run(*args):
            out = fn(*args) if name in runs else None
            calls[name] += out is not None
            return out

        return run

    for name, fn in originals.items():
        setattr(decode_blocks, name, counted(name, fn))
    try:
        config = EngineConfig(kv_cache_bytes=1 << 20, max_num_seqs=4, compile=compile)
        tokens, logits = _generate(LLMEngine(net, None, config), _prompts())
    finally:
        for name, fn in originals.items():
            setattr(decode_blocks, name, fn)
    return tokens, logits, calls


def _assert_same_run(got, want) -> None:
    assert got[0] == want[0]
    for step_want, step_got in zip(want[1], got[1], strict=True):
        for a, b in zip(step_want, step_got, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["llama", "glm4", "glm4_moe_qknorm", "gemma3_text"])
def test_an_engine_decodes_as_with_the_modules(tiny_model, name):
    net = _as_gguf_f32(copy.deepcopy(tiny_model(name)[0]))
    modules, halves, stack = (_run(net, mode) for mode in ("modules", "halves", "stack"))
    layers = len(net.model.layers)
    assert modules[2] == dict.fromkeys(modules[2], 0)
    # every decode step (the prompts' 3 sequences, then fewer) ran each layer's halves as ops
    # (the MLP's and MoE's also on a prompt's rows: they read no batch), or all layers as one
    assert halves[2]["attention_residual"] >= layers * (NUM_NEW - 1)
    assert halves[2]["mlp_residual"] >= layers * (NUM_NEW - 1)
    assert stack[2]["stack_residual"] >= NUM_NEW - 1
    assert stack[2]["attention_residual"] == 0  # every decode step in the stack
    _assert_same_run(halves, modules)
    _assert_same_run(stack, modules)


def _cached_layers(net) -> list[torch.Tensor]:
    """A fresh KV cache on every attention layer of net (as test_attention's decode batch
    addresses it), returned in layer order."""
    caches = []
    for layer in net.model.layers:
        attn = layer.self_attn
        attn.cache["kv"] = torch.randn(12, BLOCK_SIZE, 2, attn.num_kv_heads, attn.head_dim)
        caches.append(attn.cache["kv"])
    return caches


@pytest.mark.parametrize("name", ["llama", "glm4_moe_qknorm", "gemma3_text"])
def test_the_stack_follows_the_model(tiny_model, name):
    """The stack against the layers one by one; it is built again, or steps aside, when what it
    was built from changes between steps: a module swapped, a hook, another kernel, a new
    cache, a plan's expert limit."""
    net = _as_gguf_f32(copy.deepcopy(tiny_model(name)[0]))
    layers, caches = net.model.layers, _cached_layers(net)
    batch = _decode_batch([4, 7])
    x = torch.randn(2, net.config.hidden_size)
    rope = net.model.rotary_emb(batch.positions)

    def stack():
        return decode_blocks.stack_residual(layers, x, batch, rope)

    def one_by_one():
        h = x
        for layer in layers:
            h = layer(h, batch, rope)
        return h

    got = stack()
    assert got is not None, "the stack did not run"
    _close(got, one_by_one(), 1e-5)
    # a new engine's caches: the stack writes and reads those, not the old ones
    fresh = _cached_layers(net)
    old_before, fresh_before = [c.clone() for c in caches], [c.clone() for c in fresh]
    got = stack()
    assert all(map(torch.equal, caches, old_before))
    assert not any(map(torch.equal, fresh, fresh_before))
    _close(got, one_by_one(), 1e-5)
    attn, mlp = layers[1].self_attn, layers[-1].mlp
    # a hook (calibration's) sees its module's call: the layers run one by one
    handle = attn.v_proj.register_forward_hook(lambda *args: None)
    assert stack() is None
    handle.remove()
    assert stack() is not None
    # the reference kernel asked for, a module swapped for a float one
    attn.o_proj.kernel = "reference"
    assert stack() is None
    attn.o_proj.kernel = "fast"
    assert stack() is not None
    projection = mlp.shared_experts if type(mlp) is MoE else mlp
    down = projection.down_proj
    projection.down_proj = torch.nn.Linear(down.in_features, down.out_features, bias=False)
    assert stack() is None
    projection.down_proj = down
    _close(stack(), one_by_one(), 1e-5)
    # a norm's weight replaced (a loader, a plan's variant): the stack reads the new one
    norm = layers[0].input_layernorm
    norm.weight = torch.nn.Parameter(norm.weight * 2)
    _close(stack(), one_by_one(), 1e-5)
    if type(mlp) is MoE:  # a plan's expert limit: the modules for this step only
        mlp.experts_per_token = 1
        assert stack() is None
        mlp.experts_per_token = None
        assert stack() is not None


@pytest.mark.slow
def test_a_compiled_engine_decodes_as_an_eager_one(tiny_model):
    net = _as_gguf_f32(copy.deepcopy(tiny_model("llama")[0]))
    _assert_same_run(_run(net, "halves", compile=True), _run(net, "stack"))

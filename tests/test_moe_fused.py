"""The fused MoE paths against the reference expert loop.

`torch.ops.zcode.moe_fused` (zcode/kernels/moe.cpp) on fp32 and bf16 weights, and
`MoE.routed_by_module` for QuantizedLinear experts, each against the loop MoE.forward used to be
(one expert at a time over its tokens, index_add_) at 1..16 tokens, with experts no token picks,
experts every token picks and top_k = E; module swaps and hooks after a fused call; compiled
decode of the tiny MoE checkpoints against eager.
"""

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from zcode.engine.model_runner import ModelRunner
from zcode.kernels import moe as moe_kernels
from zcode.layers.mlp import GeluGatedMLP
from zcode.layers.moe import MoE
from zcode.quant.linear import QuantizedLinear

HIDDEN, INTER, NUM_EXPERTS = 96, 40, 8


def test_kernels_build_here():
    # moe.cpp has a portable path, so every CPU with a C++ compiler builds it: a failed build
    # fails here (and the tests below, which call the op) instead of skipping them.
    assert moe_kernels.fused_available()


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """MoE.forward as it was: the routed experts one at a time, then the shared expert."""
    weights, expert_ids = moe.gate(x)
    out = torch.zeros_like(x)
    for expert_id in expert_ids.unique().tolist():
        token_ids, slot = torch.where(expert_ids == expert_id)
        expert_out = moe.experts[expert_id](x[token_ids])
        out.index_add_(0, token_ids, expert_out * weights[token_ids, slot, None].to(x.dtype))
    return out + moe.shared_experts(x)


def make_moe(
    top_k: int = 2, num_experts: int = NUM_EXPERTS, seed: int = 0, inter: int = INTER
) -> MoE:
    config = SimpleNamespace(
        hidden_size=HIDDEN,
        n_routed_experts=num_experts,
        num_experts_per_tok=top_k,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        moe_intermediate_size=inter,
        n_shared_experts=1,
    )
    generator = torch.Generator().manual_seed(seed)
    moe = MoE(config)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * p.shape[-1] ** -0.5)
    return moe.requires_grad_(False)


def tolerance(dtype: torch.dtype) -> dict:
    return {"rtol": 0, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 0, "atol": 0.05}


def assert_fused_matches(x_dtype, weights, expert_ids, lists, num_shared, x):
    """The op against the reference loop in float64 on the same (rounded) weights."""
    out = torch.ops.zcode.moe_fused(x, weights, expert_ids, *lists, num_shared)
    as64 = [[w.double() for w in ws] for ws in lists]
    expected = torch.zeros(x.shape, dtype=torch.float64)
    num_routed = len(lists[0]) - num_shared
    for t in range(x.shape[0]):
        slots = [(int(e), float(w)) for e, w in zip(expert_ids[t], weights[t])]
        slots += [(num_routed + s, 1.0) for s in range(num_shared)]
        for e, w in (slot for slot in slots if slot[0] >= 0):  # -1: held elsewhere, skipped
            h = x[t].double()
            act = torch.nn.functional.silu(as64[0][e] @ h) * (as64[1][e] @ h)
            expected[t] += w * (as64[2][e] @ act)
    assert out.dtype == x_dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), expected, **tolerance(x_dtype))


def random_lists(num_experts, dtype, generator, inter=INTER):
    return [
        [
            torch.randn(inter, HIDDEN, generator=generator).to(dtype) * HIDDEN**-0.5
            for _ in range(num_experts)
        ],
        [
            torch.randn(inter, HIDDEN, generator=generator).to(dtype) * HIDDEN**-0.5
            for _ in range(num_experts)
        ],
        [
            torch.randn(HIDDEN, inter, generator=generator).to(dtype) * inter**-0.5
            for _ in range(num_experts)
        ],
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 5, 8, 9, 16, 40])
def test_fused_op_matches_reference(dtype, num_tokens):
    generator = torch.Generator().manual_seed(num_tokens)
    top_k = 3
    lists = random_lists(NUM_EXPERTS + 1, dtype, generator)  # + 1 shared, of another size
    for ws, w in zip(lists, random_lists(1, dtype, generator, inter=2 * INTER)):
        ws[-1] = w[0]
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    # Experts 0..5 only: 6 and 7 are hit by no token; 16 or 40 tokens hit some more than 8
    # times (the GEMM path), and the shared expert takes every token.
    scores = torch.rand(num_tokens, 6, generator=generator)
    weights, expert_ids = scores.topk(top_k, dim=-1)
    assert_fused_matches(dtype, weights, expert_ids, lists, 1, x)


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_every_token_every_expert(num_tokens):
    """top_k = E: every expert takes every token (a pass of all tokens, or GEMMs past 8)."""
    generator = torch.Generator().manual_seed(1)
    lists = random_lists(4, torch.float32, generator)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    weights = torch.rand(num_tokens, 4, generator=generator)
    expert_ids = torch.stack([torch.randperm(4, generator=generator) for _ in range(num_tokens)])
    assert_fused_matches(torch.float32, weights, expert_ids, lists, 0, x)


def held_elsewhere(expert_ids: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """expert_ids with about half the assignments -1 (another rank's expert), all of token 0's."""
    ids = expert_ids.masked_fill(torch.rand(expert_ids.shape, generator=generator) < 0.5, -1)
    ids[0] = -1
    return ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 3, 16])
def test_fused_op_skips_experts_held_elsewhere(dtype, num_tokens):
    assert moe_kernels.fused_available()
    generator = torch.Generator().manual_seed(7)
    lists = random_lists(NUM_EXPERTS + 1, dtype, generator)
    x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
    # 16 tokens over 3 experts: some take the GEMM path
    weights, expert_ids = torch.rand(num_tokens, 3, generator=generator).topk(2, dim=-1)
    assert_fused_matches(dtype, weights, held_elsewhere(expert_ids, generator), lists, 1, x)


@pytest.mark.parametrize("num_tokens", [1, 3, 16])
def test_expert_modules_skip_experts_held_elsewhere(num_tokens):
    """The module path (decode group GEMV and prefill sort) against the per-slot loop."""
    generator = torch.Generator().manual_seed(8)
    moe = make_moe(top_k=4)
    for expert in moe.experts:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(expert, name, QuantizedLinear.from_linear(getattr(expert, name), "w4a8"))
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    weights, expert_ids = moe.gate(x)
    expert_ids = held_elsewhere(expert_ids, generator)
    expected = moe.shared_experts(x)
    for expert_id in expert_ids.unique().tolist():
        if expert_id >= 0:  # reference_moe's loop, without the -1 slots
            token_ids, slot = torch.where(expert_ids == expert_id)
            expert_out = moe.experts[expert_id](x[token_ids])
            expected.index_add_(0, token_ids, expert_out * weights[token_ids, slot, None])
    assert moe.fused_weights(x) is None
    with torch.inference_mode():
        out = moe.run_experts(x, weights, expert_ids)
    torch.testing.assert_close(out, expected, rtol=0, atol=2e-5)


def test_fused_op_refuses_bad_weights():
    lists = random_lists(2, torch.float32, torch.Generator().manual_seed(0))
    x, weights, ids = torch.randn(1, HIDDEN), torch.ones(1, 1), torch.tensor([[2]])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.zcode.moe_fused(x, weights, ids, *lists, 0)
    lists[1][0] = lists[1][0].bfloat16()
    with pytest.raises(RuntimeError, match="weights must be"):
        torch.ops.zcode.moe_fused(x, weights, torch.tensor([[0]]), *lists, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_layer_takes_fused_op(dtype, num_tokens):
    moe = make_moe().to(dtype)
    moe.gate.float()
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(2)).to(dtype)
    assert moe.fused_weights(x) is not None
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), reference_moe(moe, x), **tolerance(dtype))


@pytest.mark.parametrize("fmt", ["int8", "w4a8", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 3, 16])
def test_quantized_experts_match_reference(fmt, num_tokens):
    """QuantizedLinear experts take the experts' own modules (one group GEMV for all selected
    gate/up at decode): the same as the loop over the same quantized modules."""
    moe = make_moe(top_k=4)
    for expert in moe.experts:
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(expert, name, QuantizedLinear.from_linear(getattr(expert, name), fmt))
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(3))
    assert moe.fused_weights(x) is None
    with torch.inference_mode():
        # int8 and bf16 round activations to bf16, at a kernel chosen per row count
        atol = 2e-5 if fmt == "w4a8" else 2e-2
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=atol)


def gguf_moe(types_by_projection: dict, with_shared: bool, seed: int = 5) -> MoE:
    """A MoE whose experts (and shared expert, with_shared) are random GGUF weights, as the
    loader makes them from a file's stacked expert tensors; expert e's projection p is of type
    types_by_projection[p][e % len]."""
    from zcode.quant.gguf import GgufWeight, format_name

    generator = torch.Generator().manual_seed(seed)
    moe = make_moe(top_k=4, inter=256)
    mlps = [*moe.experts, moe.shared_experts] if with_shared else list(moe.experts)
    for index, mlp in enumerate(mlps):
        for name, types in types_by_projection.items():
            qtype = types[index % len(types)]
            old = getattr(mlp, name)
            packed = GgufWeight.random(qtype, old.out_features, old.in_features, generator)
            setattr(mlp, name, QuantizedLinear(packed, None, format_name(qtype)))
    return moe


@pytest.mark.parametrize("num_tokens", [1, 4, 9, 40, 65])
@pytest.mark.parametrize("with_shared", [True, False])
def test_gguf_experts_match_reference(num_tokens, with_shared):
    """GGUF experts with a GGUF shared expert too: the whole layer is one ggml_moe call (40
    and 65 tokens: ~20 and ~32 a routed expert, in chunks of 8 rows); otherwise the modules.
    Either way what the loop over the same modules computes."""
    from gguf import GGMLQuantizationType as Q

    moe = gguf_moe(
        {"gate_proj": [Q.Q8_0, Q.Q4_0], "up_proj": [Q.Q8_0, Q.Q5_0], "down_proj": [Q.Q4_K, Q.Q6_K]},
        with_shared,
    )
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        takes_op = moe.gguf_weights(x) is not None
        assert takes_op == with_shared
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 9, 40, 65])
def test_float_gguf_experts_match_reference(num_tokens):
    """F32 / F16 / BF16 experts (a bf16 GGUF file's) in one ggml_moe call, up to ~32 tokens a
    routed expert and 65 for the shared one (whose module takes its GEMM path past 64 rows):
    what the loop over the same modules computes."""
    from gguf import GGMLQuantizationType as Q

    moe = gguf_moe(
        {"gate_proj": [Q.BF16, Q.F16], "up_proj": [Q.BF16, Q.F32], "down_proj": [Q.BF16, Q.F16]},
        with_shared=True,
    )
    x = torch.randn(num_tokens, HIDDEN, generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        assert moe.gguf_weights(x) is not None
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-4)


def test_gguf_experts_of_one_stacked_tensor_pass_as_one_stack():
    """Experts lying in one stacked tensor go to ggml_moe as one [E, N, row_bytes] view per
    projection (what a compiled step passes), with the result of the list of E matrices; a
    swapped expert sends the layer back to the lists."""
    from gguf import GGMLQuantizationType as Q

    from zcode.quant.gguf import GgufWeight

    moe = gguf_moe({"gate_proj": [Q.Q4_1], "up_proj": [Q.Q8_0], "down_proj": [Q.Q4_K]}, True)
    stack_experts(moe)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(9))
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(10))
    expert_ids = torch.tensor([[0, 3], [7, 1], [1, -1], [3, 0], [2, 6]])
    with torch.inference_mode():
        lists = moe.gguf_weights(x)
        assert [len(entries) for entries in lists] == [2] * 6
        assert lists[0][0].shape[0] == NUM_EXPERTS and moe.gguf_gate_stack is lists[0][0]
        matrices = [[*stack.unbind(), shared] for stack, shared in lists[:3]]
        types = [[routed] * NUM_EXPERTS + [shared] for routed, shared in lists[3:]]
        out = torch.ops.zcode.ggml_moe(x, weights, expert_ids, *lists, NUM_EXPERTS)
        listed = torch.ops.zcode.ggml_moe(x, weights, expert_ids, *matrices, *types, NUM_EXPERTS)
        assert out.equal(listed)
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-4)
        with pytest.raises(RuntimeError, match="one gate, up and down weight per expert"):
            short = [lists[0], lists[1], [lists[2][0][:4], lists[2][1]]]
            torch.ops.zcode.ggml_moe(x, weights, expert_ids, *short, *lists[3:], NUM_EXPERTS)

        old = moe.experts[2].up_proj
        copy = GgufWeight(old.packed.data.clone(), old.packed.ggml_type, old.in_features)
        moe.experts[2].up_proj = QuantizedLinear(copy, None, old.format)
        lists = moe.gguf_weights(x)
        assert [len(entries) for entries in lists[:3]] == [NUM_EXPERTS + 1] * 3
        assert moe.gguf_gate_stack is None and moe.gguf_up_stack is None
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-4)


def test_gguf_op_skips_experts_held_elsewhere():
    """Expert id -1 (another rank's expert) adds nothing; a step whose tokens all go elsewhere
    is the shared expert alone; an id past the routed experts is refused."""
    from gguf import GGMLQuantizationType as Q

    moe = gguf_moe({p: [Q.Q4_1] for p in ("gate_proj", "up_proj", "down_proj")}, True)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(7))
    weights = torch.rand(3, 2, generator=torch.Generator().manual_seed(8))
    expert_ids = torch.tensor([[1, -1], [-1, -1], [5, 1]])
    lists = moe.gguf_weights(x)
    with torch.inference_mode():
        out = torch.ops.zcode.ggml_moe(x, weights, expert_ids, *lists, NUM_EXPERTS)
        expected = moe.shared_experts(x)
        for t, row in enumerate(expert_ids.tolist()):
            for slot, e in enumerate(row):
                if e >= 0:
                    expected[t] += weights[t, slot] * moe.experts[e](x[t : t + 1])[0]
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-4)
        with pytest.raises(RuntimeError, match="outside"):
            torch.ops.zcode.ggml_moe(
                x, weights, torch.full((3, 2), NUM_EXPERTS), *lists, NUM_EXPERTS
            )


def test_swapped_expert_and_hooks_leave_the_fused_path():
    moe = make_moe(top_k=NUM_EXPERTS)  # every expert in every step
    x = torch.randn(2, HIDDEN, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        moe(x)  # gathers the weight lists
        expert = moe.experts[3]
        expert.down_proj = QuantizedLinear.from_linear(expert.down_proj, "int8")
        assert moe.fused_weights(x) is None
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-5)
        moe.experts[3] = make_moe(seed=1).experts[3]  # a float expert again, another weight
        assert moe.fused_weights(x) is not None
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-5)

        gelu = GeluGatedMLP(HIDDEN, INTER).requires_grad_(False)  # another kind of expert
        gelu.load_state_dict(moe.experts[1].state_dict())
        moe.experts[1] = gelu
        assert moe.fused_weights(x) is None
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-5)
        moe.experts[1] = make_moe().experts[1]

        seen = []
        handle = moe.experts[5].gate_proj.register_forward_pre_hook(
            lambda _m, args: seen.append(args[0].shape[0])
        )
        torch.testing.assert_close(moe(x), reference_moe(moe, x), rtol=0, atol=1e-5)
        assert seen == [2, 2]  # the layer and the reference: the expert's own rows, once each
        handle.remove()
        assert moe.fused_weights(x) is not None


def test_copied_layer_has_its_own_key():
    """Compiled graphs find a layer's modules by its key: a deep copy must not find the original."""
    import copy

    from zcode.layers.moe import _LAYERS

    moe = make_moe()
    twin = copy.deepcopy(moe)
    assert twin.layer_key != moe.layer_key
    assert _LAYERS[twin.layer_key] is twin and _LAYERS[moe.layer_key] is moe


def gguf_experts(net, qtype, stacked: bool = False) -> None:
    """Every expert projection of `net` (shared ones too) as a GgufWeight of its float weight,
    quantized by the `gguf` package; `stacked`: each layer's routed experts' rows of a projection
    are views of one [E, N, row_bytes] tensor, as a GGUF file's stacked tensors load."""
    from gguf import quantize

    from zcode.quant.gguf import GgufWeight, format_name

    for name, module in list(net.named_modules()):
        if "experts." in name and isinstance(module, torch.nn.Linear):
            blocks = quantize(module.weight.detach().float().numpy(), qtype)
            data = torch.from_numpy(blocks.view(np.uint8))
            packed = GgufWeight(data, qtype, module.in_features)
            net.set_submodule(name, QuantizedLinear(packed, None, format_name(qtype)))
    for moe in (m for m in net.modules() if stacked and isinstance(m, MoE)):
        stack_experts(moe)


def stack_experts(moe: MoE) -> None:
    """The routed experts' GGUF rows of each projection made views of one [E, N, row_bytes]
    tensor, as a GGUF file's stacked expert tensors load."""
    from zcode.quant.gguf import GgufWeight

    for proj in ("gate_proj", "up_proj", "down_proj"):
        linears = [getattr(expert, proj) for expert in moe.experts]
        stack = torch.stack([linear.packed.data for linear in linears])
        for linear, rows in zip(linears, stack):
            linear.packed = GgufWeight(rows, linear.packed.ggml_type, linear.in_features)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, fmt",
    [
        ("glm4_moe", None),
        ("glm_moe_dsa", None),
        ("glm4_moe", "int8"),
        ("glm4_moe", "gguf-q8_0"),
        ("glm4_moe", "gguf-q8_0-stacked"),
    ],
)
def test_compiled_moe_decode_matches_eager(tiny_checkpoint, monkeypatch, name, fmt):
    """Float experts: moe_fused in the graph; GGUF experts of a file's stacked tensors: ggml_moe
    in the graph; int8 and other GGUF experts: the opaque zcode::moe_eager (GGUF: ggml_moe
    inside it), which runs the layer's Python at every compiled step."""
    from zcode.config import EngineConfig
    from zcode.engine.llm_engine import LLMEngine
    from zcode.loader import load_model
    from zcode.quant.apply import apply_precision, quantizable_modules
    from zcode.sampling_params import SamplingParams

    net, _ = load_model(tiny_checkpoint(name).path)
    if fmt and fmt.startswith("gguf"):
        from gguf import GGMLQuantizationType

        gguf_experts(net, GGMLQuantizationType.Q8_0, stacked=fmt.endswith("stacked"))
        x = torch.randn(1, net.config.hidden_size)
        assert net.model.layers[1].mlp.gguf_weights(x) is not None  # ggml_moe at decode
        stacks = net.model.layers[1].mlp.gguf_gate_stack
        assert (stacks is not None) == fmt.endswith("stacked")
    elif fmt is not None:
        apply_precision(net, {n: fmt for n in quantizable_modules(net) if ".experts." in n})
    prompts = [[5, 9, 14, 3, 22, 7], [40, 41, 2, 3, 90, 12, 13, 60, 61]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def generate(compile: bool):
        config = EngineConfig(kv_cache_bytes=1 << 20, compile=compile, max_num_seqs=2)
        engine = LLMEngine(net, None, config)
        seqs = [engine.add_request(p, params) for p in prompts]
        logits, execute = [], engine.runner.execute
        engine.runner.execute = lambda s, levels=None: (
            logits.append(execute(s, levels)) or logits[-1]
        )
        while engine.has_unfinished():
            engine.step()
        return engine, [s.output_token_ids for s in seqs], logits

    _, eager_tokens, eager_logits = generate(compile=False)
    gguf_steps = []  # the layers' ggml_moe lists, which compiled graphs take inside moe_eager
    step_lists = MoE._step_lists
    monkeypatch.setattr(
        MoE, "_step_lists", lambda m, x: gguf_steps.append(step_lists(m, x)) or gguf_steps[-1]
    )
    python_in_graph_steps = []  # a layer's Python run by a compiled step (moe_eager)
    run_experts, execute_compiled = MoE.run_experts, ModelRunner._execute_compiled

    def spy_run_experts(moe, *args):
        if in_compiled_step and not torch.compiler.is_compiling():
            python_in_graph_steps.append(moe)
        return run_experts(moe, *args)

    def spy_execute_compiled(runner, scheduled):
        nonlocal in_compiled_step
        in_compiled_step = True
        try:
            return execute_compiled(runner, scheduled)
        finally:
            in_compiled_step = False

    in_compiled_step = False
    monkeypatch.setattr(MoE, "run_experts", spy_run_experts)
    monkeypatch.setattr(ModelRunner, "_execute_compiled", spy_execute_compiled)
    compiled, tokens, logits = generate(compile=True)
    assert any(gguf is not None for _, gguf in gguf_steps) == bool(fmt and "gguf" in fmt)
    assert bool(python_in_graph_steps) == (fmt in ("int8", "gguf-q8_0"))
    assert compiled.stats()["num_graph_compiles"] > 0
    assert compiled.runner.graphs.direct  # later steps called the graph without dynamo
    assert tokens == eager_tokens
    for step_eager, step in zip(eager_logits, logits, strict=True):
        for a, b in zip(step_eager, step, strict=True):
            torch.testing.assert_close(b[-1], a[-1], rtol=0, atol=1e-4)

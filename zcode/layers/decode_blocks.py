"""A decoder layer's attention half and MLP half at a decode step, each as one C++ call.

Where every module of a half runs GGUF weights on their C++ kernels, the half's norms (input,
QK-norm, GLM-4's and Gemma 3's post-norms, Gemma's offsets from 1), GEMVs, RoPE, cache write,
attention, SiLU or GELU and residual add run inside zcode.kernels.ggml's `ggml_attention_block` /
`ggml_mlp_block`, and a MoE layer's norm, router (sigmoid scores, correction bias, groups, top-k)
and experts inside `ggml_moe_block` (same math as the modules, in fp32). Between a decode step's
GEMVs the model's ops are a few hundred floats each, and one PyTorch op at a time their dispatch
cost several times their arithmetic: SmolLM2's Q4_0 file decoded eagerly in ~15 ms a step against
4.6 compiled (~7.5 with these ops), Gemma-3's Q4_K_M ~18 against ~10 (~11), a GLM-4.5-Air-shaped
1.3B Q4_0 file 15.4 against 8.6-9.1 (11.6). Anything else runs the modules: other weight formats,
activations not fp32, prefill and verifying steps (the attention half), per-request depth (head
pages, skipped heads), module hooks (calibration's), plans that swap a module (FFN sparsity levels)
or limit a MoE's experts, the expert cache's counted lookups (offload).

`attention_half` and `mlp_half` are what a layer's forward calls; `attention_residual` and
`mlp_residual` return None where the half does not qualify (the halves then run the modules). What
a half's modules hold (weights, kernel choice, hooks) is checked once and kept while the same
objects stay in place (~50 us a half checked every call, eagerly, against ~60 us for the op
itself); a compiled step traces the checks (the graph's guards) and calls the op as one extern
kernel.
"""

import weakref
from collections.abc import Callable

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers.attention import Attention, paged_attention_kernel
from zcode.layers.mlp import GatedMLP, GeluGatedMLP
from zcode.layers.moe import MoE, TopkRouter
from zcode.layers.norm import RMSNorm
from zcode.quant.gguf import GgufWeight, ggml_available, has_kernel
from zcode.quant.linear import QuantizedLinear

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")
ACTIVATIONS = {GatedMLP: 0, GeluGatedMLP: 1}  # ggml_mlp_block's activation: SiLU, GELU (tanh)


def attention_half(
    attn: nn.Module,
    norm: nn.Module,
    x: torch.Tensor,
    batch: ForwardBatch,
    rope,
    post_norm: nn.Module | None = None,
) -> torch.Tensor:
    """x + post_norm(attn(norm(x))) (no post_norm: x + attn(norm(x))): one call where the half
    qualifies, else its modules."""
    if (out := attention_residual(attn, norm, x, batch, rope, post_norm)) is not None:
        return out
    out = attn(norm(x), batch, rope)
    return x + (out if post_norm is None else post_norm(out))


def mlp_half(
    mlp: nn.Module, norm: nn.Module, x: torch.Tensor, post_norm: nn.Module | None = None
) -> torch.Tensor:
    """x + post_norm(mlp(norm(x))) (no post_norm: x + mlp(norm(x))): one call where the half
    qualifies, else its modules."""
    if (out := mlp_residual(mlp, norm, x, post_norm)) is not None:
        return out
    out = mlp(norm(x))
    return x + (out if post_norm is None else post_norm(out))


def attention_residual(
    attn: nn.Module,
    norm: nn.Module,
    x: torch.Tensor,
    batch: ForwardBatch,
    rope,
    post_norm: nn.Module | None = None,
) -> torch.Tensor | None:
    """x + post_norm(attn(norm(x))) [T, hidden] in one call (no post_norm: x + attn(norm(x))),
    or None (see the module docstring)."""
    if not (
        type(attn) is Attention
        and _decode_rows(x, batch)
        and batch.slot_mapping.dim() == 1  # not pages per KV head
        and isinstance(rope, tuple)
    ):
        return None
    cache = attn.cache["kv"]
    qk_norms = (attn._modules.get("q_norm"), attn._modules.get("k_norm"))
    norms = (norm, post_norm, *qk_norms)
    kept = _weights(attn, norms, ATTENTION_LINEARS, _attention_weights, cache)
    if kept is None or x.shape[0] > kept[1]:
        return None
    mask = (
        batch.attn_mask if attn.sliding_window is None else batch.window_mask(attn.sliding_window)
    )
    return torch.ops.zcode.ggml_attention_block(
        x, *rope, cache, batch.slot_mapping, batch.context_slots, mask, *kept[0]
    )


def mlp_residual(
    mlp: nn.Module, norm: nn.Module, x: torch.Tensor, post_norm: nn.Module | None = None
) -> torch.Tensor | None:
    """x + post_norm(mlp(norm(x))) [T, hidden] in one call (no post_norm: x + mlp(norm(x))), or
    None (see the module docstring). A MoE layer routes and runs its experts in the one call
    too."""
    if not _fp32_rows(x):
        return None
    if type(mlp) is MoE:
        return _moe_residual(mlp, norm, x, post_norm)
    if type(mlp) not in ACTIVATIONS:
        return None
    kept = _weights(mlp, (norm, post_norm), MLP_LINEARS, _mlp_weights)
    if kept is None or x.shape[0] > kept[1]:
        return None
    return torch.ops.zcode.ggml_mlp_block(x, *kept[0])


def _moe_residual(moe: MoE, norm: nn.Module, x: torch.Tensor, post_norm) -> torch.Tensor | None:
    router = moe.gate
    if not (
        post_norm is None
        and moe.experts_per_token is None  # no plan's expert limit
        and moe.token_experts is None
        and moe.expert_mass is None
        and moe.expert_counts is None  # no expert cache counting its lookups
        and type(router) is TopkRouter
        and router.weight.dtype == torch.float32
        and router.weight.is_contiguous()
        and _plain_norm(norm)
        and not norm.unit_offset
        and not _hooked((moe, router, norm))
    ):
        return None
    if (experts := moe.ggml_lists(x)) is None:  # float experts, a hook or a swapped module
        return None
    return torch.ops.zcode.ggml_moe_block(
        x,
        norm.weight,
        norm.eps,
        router.weight,
        router.e_score_correction_bias.float(),
        router.top_k,
        router.num_groups,
        min(router.topk_groups, router.num_groups),
        router.norm_topk_prob,
        router.routed_scaling_factor,
        *experts,
        len(moe.experts),
    )


def _attention_weights(attn: nn.Module, norms: tuple, linears, cache: torch.Tensor):
    norm, post_norm, q_norm, k_norm = norms
    query = torch.empty(0, attn.num_heads, attn.head_dim)  # fp32, as _decode_rows
    if not paged_attention_kernel().supports(query, cache) or linears[3].bias is not None:
        return None
    biases = [m.bias for m in linears[:3]]
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    if (q_norm is None) != (k_norm is None) or (q_norm and q_norm.eps != k_norm.eps):
        return None
    qkv = [m.packed for m in linears[:3]]
    return (
        norm.weight,
        norm.eps,
        [w.data for w in qkv],
        [w.kernel_type for w in qkv],
        None if biases[0] is None else torch.cat(biases).float(),
        None if q_norm is None else q_norm.weight,
        None if k_norm is None else k_norm.weight,
        0.0 if q_norm is None else q_norm.eps,
        attn.interleaved_rope,
        attn.num_heads,
        attn.num_kv_heads,
        attn.scale,
        linears[3].packed.data,
        linears[3].packed.kernel_type,
        None if post_norm is None else post_norm.weight,
        norm.unit_offset,
    )


def _mlp_weights(mlp: nn.Module, norms: tuple, linears) -> tuple | None:
    norm, post_norm = norms
    if any(m.bias is not None for m in linears):
        return None
    gate, up, down = (m.packed for m in linears)
    return (
        norm.weight,
        norm.eps,
        [gate.data, up.data],
        [gate.kernel_type, up.kernel_type],
        down.data,
        down.kernel_type,
        None if post_norm is None else post_norm.weight,
        norm.unit_offset,
        ACTIVATIONS[type(mlp)],
    )


# half's module -> (the objects its arguments were read from, what _build gave)
_KEPT: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _weights(half: nn.Module, norms: tuple, names: tuple[str, ...], build: Callable, *extra):
    """(the half's op arguments after the per-step ones, the rows its GEMVs take), or None where
    its modules do not qualify; rebuilt when one of the objects they come from was replaced, a
    kernel choice changed or a hook was added. `norms`: the half's RMSNorms, the input's first
    (None where the half has no such norm); `extra`: further arguments of `build`, kept by
    identity too (the KV cache, which a new engine replaces)."""
    linears = tuple(half._modules.get(name) for name in names)
    if torch.compiler.is_compiling():
        return _build(half, norms, linears, build, extra)
    sources = (*_sources(half, norms, linears), *extra)
    kept = _KEPT.get(half)
    if kept is None or len(kept[0]) != len(sources) or any(map(_differs, kept[0], sources)):
        kept = _KEPT[half] = (sources, _build(half, norms, linears, build, extra))
    return kept[1]


def _differs(a: object, b: object) -> bool:
    return a is not b


def _sources(half: nn.Module, norms: tuple, linears) -> tuple:
    """Every object a half's op arguments are read from, and its hooks (identities)."""
    norms = tuple(n for n in norms if n is not None)
    modules = (half, *norms, *linears)
    packed = tuple(getattr(m, "_modules", {}).get("packed") for m in linears)
    kernels = tuple(getattr(m, "_kernel", None) for m in linears)
    hooks = tuple(h for m in modules for h in (m._forward_hooks, m._forward_pre_hooks) if h)
    weights = tuple(n._parameters.get("weight") for n in norms)
    return (*modules, *packed, *kernels, *hooks, *weights)


def _build(half: nn.Module, norms: tuple, linears, build: Callable, extra) -> tuple | None:
    present = [n for n in norms if n is not None]
    if not (
        all(map(_plain_norm, present))
        and len({n.unit_offset for n in present}) == 1  # the ops take one kind for all
        and (norms[1] is None or norms[1].eps == norms[0].eps)  # the ops take one eps for both
        and all(_fast_gguf(m) for m in linears)
        and ggml_available()
        and not _hooked((half, *present, *linears))
    ):
        return None
    args = build(half, norms, linears, *extra)
    return None if args is None else (args, min(m.packed.gemv_max_rows for m in linears))


def _fp32_rows(x: torch.Tensor) -> bool:
    return x.dim() == 2 and x.dtype == torch.float32 and x.is_contiguous()


def _decode_rows(x: torch.Tensor, batch: ForwardBatch) -> bool:
    """One token per sequence, row t sequence t, fp32 activations, every head of every row."""
    return (
        _fp32_rows(x)
        and batch.query_index.shape == (x.shape[0], 1)
        and batch.paging is None
        and batch.kv_head_keep is None
    )


def _plain_norm(norm: nn.Module) -> bool:
    """An RMSNorm the ops compute (unit_offset or not, fp32 weight)."""
    return (
        type(norm) is RMSNorm and norm.weight.dtype == torch.float32 and norm.weight.is_contiguous()
    )


def _hooked(modules) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def _fast_gguf(linear: nn.Module | None) -> bool:
    """A GGUF weight on the C++ GEMV, as linear_group runs it."""
    return (
        type(linear) is QuantizedLinear
        and linear.kernel == "fast"
        and type(linear.packed) is GgufWeight
        and has_kernel(linear.packed.ggml_type)
    )

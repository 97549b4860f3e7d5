"""A decoder layer's attention half and MLP half at a decode step, each as one C++ call.

Where every module of a half runs GGUF weights on their C++ kernels, the half's norm, GEMVs,
RoPE, cache write, attention, SiLU and residual add run inside zcode.kernels.ggml's
`ggml_attention_block` / `ggml_mlp_block` (same math as the modules, in fp32). Between a decode
step's GEMVs the model's ops are a few hundred floats each, and one PyTorch op at a time their
dispatch cost several times their arithmetic: SmolLM2's Q4_0 file decoded eagerly in 14.6 ms a
step against 4.6 compiled. Anything else runs the modules: other weight formats, activations not
fp32, prefill and verifying steps, per-request depth (head pages, skipped heads), QK-norm, module
hooks (calibration's), plans that swap a module (FFN sparsity levels).

`attention_residual` and `mlp_residual` return None where the half does not qualify; the caller
then runs its modules. What a half's modules hold (weights, kernel choice, hooks) is checked once
and kept while the same objects stay in place (~50 us a half checked every call, eagerly, against
~60 us for the op itself); a compiled step traces the checks (the graph's guards) and calls the op
as one extern kernel.
"""

import weakref
from collections.abc import Callable

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers.attention import Attention, paged_attention_kernel
from zcode.layers.mlp import GatedMLP
from zcode.layers.norm import RMSNorm
from zcode.quant.gguf import GgufWeight, ggml_available, has_kernel
from zcode.quant.linear import QuantizedLinear

ATTENTION_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")


def attention_residual(
    attn: nn.Module, norm: nn.Module, x: torch.Tensor, batch: ForwardBatch, rope
) -> torch.Tensor | None:
    """x + attn(norm(x)) [T, hidden] in one call, or None (see the module docstring)."""
    if not (
        type(attn) is Attention
        and _decode_rows(x, batch)
        and batch.slot_mapping.dim() == 1  # not pages per KV head
        and isinstance(rope, tuple)
    ):
        return None
    cache = attn.cache["kv"]
    kept = _weights(attn, norm, ATTENTION_LINEARS, _attention_weights, cache)
    if kept is None or x.shape[0] > kept[1]:
        return None
    mask = (
        batch.attn_mask if attn.sliding_window is None else batch.window_mask(attn.sliding_window)
    )
    return torch.ops.zcode.ggml_attention_block(
        x, *rope, cache, batch.slot_mapping, batch.context_slots, mask, *kept[0]
    )


def mlp_residual(mlp: nn.Module, norm: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """x + mlp(norm(x)) [T, hidden] in one call, or None (see the module docstring)."""
    if not (type(mlp) is GatedMLP and _fp32_rows(x)):
        return None
    kept = _weights(mlp, norm, MLP_LINEARS, _mlp_weights)
    if kept is None or x.shape[0] > kept[1]:
        return None
    return torch.ops.zcode.ggml_mlp_block(x, *kept[0])


def _attention_weights(attn: nn.Module, norm: nn.Module, linears, cache: torch.Tensor):
    biases = [m.bias for m in linears[:3]]
    query = torch.empty(0, attn.num_heads, attn.head_dim)  # fp32, as _decode_rows
    if not paged_attention_kernel().supports(query, cache):
        return None
    if hasattr(attn, "q_norm") or linears[3].bias is not None:
        return None
    if any(b is None for b in biases) and any(b is not None for b in biases):
        return None
    qkv = [m.packed for m in linears[:3]]
    return (
        norm.weight,
        norm.eps,
        [w.data for w in qkv],
        [w.kernel_type for w in qkv],
        None if biases[0] is None else torch.cat(biases).float(),
        attn.interleaved_rope,
        attn.num_heads,
        attn.num_kv_heads,
        attn.scale,
        linears[3].packed.data,
        linears[3].packed.kernel_type,
    )


def _mlp_weights(mlp: nn.Module, norm: nn.Module, linears) -> tuple | None:
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
    )


# half's module -> (the objects its arguments were read from, what _build gave)
_KEPT: "weakref.WeakKeyDictionary[nn.Module, tuple]" = weakref.WeakKeyDictionary()


def _weights(half: nn.Module, norm: nn.Module, names: tuple[str, ...], build: Callable, *extra):
    """(the half's op arguments after the per-step ones, the rows its GEMVs take), or None where
    its modules do not qualify; rebuilt when one of the objects they come from was replaced, a
    kernel choice changed or a hook was added. `extra`: further arguments of `build`, kept by
    identity too (the KV cache, which a new engine replaces)."""
    linears = tuple(half._modules.get(name) for name in names)
    if torch.compiler.is_compiling():
        return _build(half, norm, linears, build, extra)
    sources = (*_sources(half, norm, linears), *extra)
    kept = _KEPT.get(half)
    if kept is None or len(kept[0]) != len(sources) or any(map(_differs, kept[0], sources)):
        kept = _KEPT[half] = (sources, _build(half, norm, linears, build, extra))
    return kept[1]


def _differs(a: object, b: object) -> bool:
    return a is not b


def _sources(half: nn.Module, norm: nn.Module, linears) -> tuple:
    """Every object a half's op arguments are read from, and its hooks (identities)."""
    modules = (half, norm, *linears)
    packed = tuple(getattr(m, "_modules", {}).get("packed") for m in linears)
    kernels = tuple(getattr(m, "_kernel", None) for m in linears)
    hooks = tuple(h for m in modules for h in (m._forward_hooks, m._forward_pre_hooks) if h)
    return (*modules, *packed, *kernels, *hooks, norm._parameters.get("weight"))


def _differs(a: object, b: object) -> bool:
    return a is not b


def _build(half: nn.Module, norm: nn.Module, linears, build: Callable, extra) -> tuple | None:
    if not (
        _plain_norm(norm)
        and all(_fast_gguf(m) for m in linears)
        and ggml_available()
        and not any(m._forward_hooks or m._forward_pre_hooks for m in (half, norm, *linears))
    ):
        return None
    args = build(half, norm, linears, *extra)
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
    return (
        type(norm) is RMSNorm
        and not norm.unit_offset
        and norm.weight.dtype == torch.float32
        and norm.weight.is_contiguous()
    )


def _fast_gguf(linear: nn.Module | None) -> bool:
    """A GGUF weight on the C++ GEMV, as linear_group runs it."""
    return (
        type(linear) is QuantizedLinear
        and linear.kernel == "fast"
        and type(linear.packed) is GgufWeight
        and has_kernel(linear.packed.ggml_type)
    )

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

An eager decode step runs every layer in one call where every half qualifies (`stack_residual`:
a `DecodeStack` holding each half's arguments): the ~30 us of Python a layer spent around its two
ops (the checks, the dispatcher's argument parsing) become one identity check of what the stack
was built from (SmolLM2: ~1300 objects compared in C, ~50 us a step; a MoE layer's experts
through MoE.ggml_lists, ~20 us each). Same process, the two alternated, min ms a token: SmolLM2
Q4_0 8.9 -> 7.2, Gemma-3 Q4_K_M 13.3 -> 12.1, the 1.3B GLM-4.5-Air-shaped Q4_0 file 11.9 -> 11.1.
Layers declare their halves by attribute names (`PreNormLayer.HALVES`), which both paths read.
"""

import itertools
import operator
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


class PreNormLayer(nn.Module):
    """A decoder layer of two pre-norm residual halves, x + post_norm(attn(norm(x))) then
    x + post_norm(mlp(norm(x))) (an MLP or a MoE), each half one C++ call at a GGUF model's
    decode step, else module by module. `HALVES`: the (module, norm, post-norm or None)
    attribute names of the attention half, then of the MLP half."""

    HALVES: tuple = (
        ("self_attn", "input_layernorm", None),
        ("mlp", "post_attention_layernorm", None),
    )

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope) -> torch.Tensor:
        (attn, norm, post_norm), (mlp, mlp_norm, mlp_post_norm) = self.halves()
        h = attention_half(attn, norm, x, batch, self.layer_rope(rope), post_norm)
        return mlp_half(mlp, mlp_norm, h, mlp_post_norm)

    def halves(self) -> tuple[tuple, tuple]:
        """The modules HALVES names (None for a half without a post-norm)."""
        return tuple(tuple(n and self._modules[n] for n in names) for names in self.HALVES)

    def layer_rope(self, rope):
        """The (cos, sin) pair of this layer in the model's rotary output (Gemma's: one per layer
        type)."""
        return rope


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
    if not (_decode_step(x, batch) and isinstance(rope, tuple)):
        return None
    kept = _attention_args(attn, norm, post_norm)
    if kept is None or x.shape[0] > kept[1]:
        return None
    mask = (
        batch.attn_mask if attn.sliding_window is None else batch.window_mask(attn.sliding_window)
    )
    return torch.ops.zcode.ggml_attention_block(
        x, *rope, attn.cache["kv"], batch.slot_mapping, batch.context_slots, mask, *kept[0]
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
        args = _moe_args(mlp, norm, x, post_norm) if _moe_unlimited(mlp) else None
        return None if args is None else torch.ops.zcode.ggml_moe_block(x, *args)
    kept = _mlp_args(mlp, norm, post_norm)
    if kept is None or x.shape[0] > kept[1]:
        return None
    return torch.ops.zcode.ggml_mlp_block(x, *kept[0])


def _attention_args(attn: nn.Module, norm: nn.Module, post_norm) -> tuple | None:
    """(ggml_attention_block's arguments after the mask, the rows its GEMVs take), or None."""
    if type(attn) is not Attention or (cache := attn.cache.get("kv")) is None:
        return None
    norms = (norm, post_norm, attn._modules.get("q_norm"), attn._modules.get("k_norm"))
    return _weights(attn, norms, ATTENTION_LINEARS, _attention_weights, cache)


def _mlp_args(mlp: nn.Module, norm: nn.Module, post_norm) -> tuple | None:
    """(ggml_mlp_block's arguments after x, the rows its GEMVs take), or None."""
    if type(mlp) not in ACTIVATIONS:
        return None
    return _weights(mlp, (norm, post_norm), MLP_LINEARS, _mlp_weights)


def _moe_unlimited(moe: MoE) -> bool:
    """No plan's expert limit, no expert cache counting its lookups: what the op computes (set
    per step: not kept)."""
    return (
        moe.experts_per_token is None
        and moe.token_experts is None
        and moe.expert_mass is None
        and moe.expert_counts is None
    )


def _moe_args(moe: MoE, norm: nn.Module, x: torch.Tensor, post_norm) -> tuple | None:
    """ggml_moe_block's arguments after x, or None."""
    router = moe.gate
    if not (
        post_norm is None
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
    return (
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


def stack_residual(layers: nn.ModuleList, x: torch.Tensor, batch: ForwardBatch, rope):
    """x [T, hidden] through every layer of `layers` in one call at an eager decode step, or
    None where a layer is not a PreNormLayer, one of its halves does not qualify, or this step
    runs them module by module (a hook, a plan's expert limit, the expert cache counting)."""
    if torch.compiler.is_compiling() or not _decode_step(x, batch):
        return None
    stack = _STACKS.get(layers)
    if stack is None or not stack.current(x):
        stack = _STACKS[layers] = _Stack(layers)
    if not stack.step_runs_ops():
        return None
    if stack.op is None:
        stack.build(layers, x, rope)
    if stack.op is False or x.shape[0] > stack.max_rows:
        return None
    ropes = [layers[i].layer_rope(rope) for i in stack.rope_layers]
    if not all(isinstance(pair, tuple) for pair in ropes):
        return None
    masks = [batch.attn_mask if w is None else batch.window_mask(w) for w in stack.windows]
    tables = list(itertools.chain.from_iterable(ropes))
    return stack.op.run(x, tables, batch.slot_mapping, batch.context_slots, masks)


class _Stack:
    """What one DecodeStack of a model's layers was built from: the (holder dict, key, object)
    of every module, parameter, buffer, packed weight, kernel choice and KV cache its halves read
    (compared by identity each step: a swapped module or a new engine's cache builds it again),
    the hook dicts and per-step settings that send a step to the modules instead, and each MoE
    layer's expert lists. `op`: None until built, False where a half does not qualify."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.holders: list[dict] = []
        self.keys: list[str] = []
        self.objects: list[object] = []
        self.hook_dicts: list[dict] = []
        self.moes: list[MoE] = []
        self.moe_lists: list = []
        self.op = False
        for key, layer in layers._modules.items():
            self._watch(layers._modules, key)
            if not isinstance(layer, PreNormLayer):
                return
            for names in layer.HALVES:
                for name in filter(None, names):
                    self._watch(layer._modules, name)
                    self._walk(layer._modules[name])
            if type(mlp := layer._modules[layer.HALVES[1][0]]) is MoE:
                self.moes.append(mlp)
        self.op = None

    def _watch(self, holder: dict, key: str) -> None:
        self.holders.append(holder)
        self.keys.append(key)
        self.objects.append(holder.get(key))

    def _walk(self, module: nn.Module) -> None:
        """A half's module or norm: its tensors, children (not a MoE's experts: their lists are
        compared whole), their packed weights and kernel choices, hooks and KV cache."""
        self.hook_dicts += [module._forward_hooks, module._forward_pre_hooks]
        for holder in (module._parameters, module._buffers):
            for key in holder:
                self._watch(holder, key)
        if isinstance(cache := module.__dict__.get("cache"), dict):
            self._watch(cache, "kv")
        for key, child in module._modules.items():
            self._watch(module._modules, key)
            if child is not None and not isinstance(child, nn.ModuleList):
                self._walk(child)
        if "_kernel" in module.__dict__:
            self._watch(module.__dict__, "_kernel")

    def current(self, x: torch.Tensor) -> bool:
        """Whether every object it was built from is still in place (in C: ~30 ns each)."""
        return all(map(operator.is_, map(dict.get, self.holders, self.keys), self.objects)) and all(
            moe.ggml_lists(x) is lists for moe, lists in zip(self.moes, self.moe_lists)
        )

    def step_runs_ops(self) -> bool:
        return not any(self.hook_dicts) and all(map(_moe_unlimited, self.moes))

    def build(self, layers: nn.ModuleList, x: torch.Tensor, rope) -> None:
        self.max_rows, self.rope_layers, self.windows, pairs = 1 << 62, [], [], []
        self.op, self.moe_lists, op = False, [], None
        for i, layer in enumerate(layers):
            (attn, norm, post_norm), (mlp, mlp_norm, mlp_post_norm) = layer.halves()
            if (kept := _attention_args(attn, norm, post_norm)) is None:
                return
            if op is None:  # the ops' library is loaded by now
                op = torch.classes.zcode.DecodeStack()
            pair = layer.layer_rope(rope)
            if not any(pair is p for p in pairs):
                pairs.append(pair)
                self.rope_layers.append(i)
            if attn.sliding_window not in self.windows:
                self.windows.append(attn.sliding_window)
            rope_index = next(j for j, p in enumerate(pairs) if p is pair)
            mask_index = self.windows.index(attn.sliding_window)
            op.add_attention(rope_index, mask_index, attn.cache["kv"], *kept[0])
            self.max_rows = min(self.max_rows, kept[1])
            if type(mlp) is MoE:
                if (args := _moe_args(mlp, mlp_norm, x, mlp_post_norm)) is None:
                    return
                self.moe_lists.append(mlp.ggml_lists(x))
                op.add_moe(*args)
            elif (kept := _mlp_args(mlp, mlp_norm, mlp_post_norm)) is not None:
                op.add_mlp(*kept[0])
                self.max_rows = min(self.max_rows, kept[1])
            else:
                return
        self.op = op


# the layers of a model -> what its DecodeStack was built from
_STACKS: "weakref.WeakKeyDictionary[nn.ModuleList, _Stack]" = weakref.WeakKeyDictionary()


def _attention_weights(attn: nn.Module, norms: tuple, linears, cache: torch.Tensor):
    norm, post_norm, q_norm, k_norm = norms
    query = torch.empty(0, attn.num_heads, attn.head_dim)  # fp32, as _decode_step
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


def _decode_step(x: torch.Tensor, batch: ForwardBatch) -> bool:
    """One token per sequence, row t sequence t, fp32 activations, every head of every row, one
    slot per token (not pages per KV head)."""
    return (
        _fp32_rows(x)
        and batch.query_index.shape == (x.shape[0], 1)
        and batch.paging is None
        and batch.kv_head_keep is None
        and batch.slot_mapping.dim() == 1
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

"""DeepSeek-V3-style MoE (GLM-4.5+, GLM-5): sigmoid router with bias-corrected group top-k,
routed SwiGLU experts and an always-on shared expert.

The experts stay modules (`experts.E.{gate,up,down}_proj`, HF names): the loader, the weight
formats (QuantizedLinear) and expert skipping replace them one by one. A step runs them one of
three ways, only the last a Python loop over the step's experts:
- fp32 / bf16 `Linear` experts: `torch.ops.zcode.moe_fused` (zcode/kernels/moe.cpp), one C++ call
  for the routed and the shared experts over lists of the experts' weights (gathered once, and
  again when a module is swapped);
- GGUF experts (QuantizedLinear of GgufWeight, as a GGUF file loads): `torch.ops.zcode.ggml_moe`
  (zcode/kernels/ggml.cpp), likewise one call, on the stored blocks, prefill too (on Zen 5 its
  int8 GEMVs on each expert's tokens led dequantized fp32 GEMMs up to 512 rows; for F16/BF16
  experts the GEMV's fp32 FMAs lose past ~64 rows an expert, a cost bench_glm_scale's bf16
  prefill shows);
- any other module (QuantizedLinear of any format, hooked modules): `routed_by_module`, the
  experts' own forwards; at decode all selected experts' gate/up projections are one group GEMV
  (`linear_group`: the activation read and quantized once).
Compiled graphs trace moe_fused, and ggml_moe where the routed experts lie in one stacked tensor
of the file (as a GGUF file loads: the graph passes one [E, N, row_bytes] view per projection,
not a list of E tensors, and calls the C++ op without Python); the other paths run inside the
opaque op `zcode::moe_eager`, as at eager, so no path breaks a decode graph (and no graph traces
a walk over the experts' modules).

Expert id -1 in `run_experts` is an assignment to an expert this layer does not hold (expert
parallelism, zcode/distributed/layers.py: another rank's); every path skips it.

A plan may run fewer routed experts per token than the router's top_k (`experts_per_token`,
the plan's experts dimension, or per token inside `tokens_with_experts` when the rows of one
forward run different plans; `expert_mass`: only as many as reach that share of the token's
routing weight): `route` keeps each token's first experts in the router's order (its choice
score, bias-corrected, highest first) and drops the others (id -1, which every path skips); a
router that normalizes its top-k weights (GLM's norm_topk_prob) normalizes the kept ones. At k
experts that is the router with top_k = k: what transformers, and llama.cpp with
`expert_used_count` overridden, run.

With expert offload (zcode/engine/expert_cache.py) a layer hands its routed expert ids to the
op `zcode::expert_lookup` (defined there), which counts them into the layer's `expert_counts`
[E] (compiled graphs too) and reads in the experts not resident; without, `expert_counts` is None.
"""

import contextlib
import itertools
import operator
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from zcode.layers.linear import Linear, linear_group
from zcode.layers.mlp import GatedMLP
from zcode.quant.formats import GEMV_MAX_ROWS
from zcode.quant.gguf import GgufWeight, ggml_available, has_kernel
from zcode.quant.linear import QuantizedLinear

FUSED_DTYPES = (torch.float32, torch.bfloat16)
_PROJECTIONS = operator.itemgetter("gate_proj", "up_proj", "down_proj")
_SUBMODULES = operator.attrgetter("_modules")
_HOOKS = operator.attrgetter("_forward_hooks", "_forward_pre_hooks")


class TopkRouter(nn.Module):
    """noaux_tc routing: choose experts by sigmoid score + correction bias within the best groups,
    weight them by the uncorrected score."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        num_groups: int,
        topk_groups: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))
        self.num_experts, self.top_k = num_experts, top_k
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.norm_topk_prob = norm_topk_prob
        self.routed_scaling_factor = routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x: [T, D] -> weights [T, top_k] fp32, expert ids [T, top_k]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.topk_groups < self.num_groups:  # else every group is kept (GLM-4.5: 1 of 1)
            grouped = choice.view(-1, self.num_groups, self.num_experts // self.num_groups)
            group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
            group_ids = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
            group_keep = torch.zeros_like(group_scores, dtype=torch.bool)
            group_keep.scatter_(1, group_ids, True)
            expert_keep = group_keep.repeat_interleave(self.num_experts // self.num_groups, dim=1)
            choice = choice.masked_fill(~expert_keep, float("-inf"))
        # sorted: the first k of a row are its top-k for any k (MoE.route's expert limits)
        expert_ids = choice.topk(self.top_k, dim=-1, sorted=True).indices
        weights = scores.gather(1, expert_ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, expert_ids


class MoE(nn.Module):
    def __init__(self, hf_config) -> None:
        super().__init__()
        c = hf_config
        self.gate = TopkRouter(
            c.hidden_size,
            c.n_routed_experts,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        self.experts = nn.ModuleList(
            GatedMLP(c.hidden_size, c.moe_intermediate_size) for _ in range(c.n_routed_experts)
        )
        self.shared_experts = GatedMLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)
        # (projection modules per expert, shared last) -> their weights as three lists, or None
        # where they are not all plain float Linears of one dtype; their GGUF rows and types, or
        # None where they are not all GGUF weights; and those modules' hook dicts.
        self._projections: tuple = ()
        self._fused_weights: tuple[list, list, list] | None = None
        self._gguf_weights: tuple | None = None
        self._hook_dicts: list[dict] = []
        # The routed experts' GGUF rows as one [E, N, row_bytes] view each (gate, up, down) where
        # they lie in one stacked tensor of the file, as a compiled step passes them (plain tensor
        # attributes: DirectStep finds graph inputs among the model's tensors), else None.
        self.gguf_gate_stack = self.gguf_up_stack = self.gguf_down_stack = None
        self.register_buffer("expert_counts", None, persistent=False)
        # Routed experts a token runs: the plan's (None: all top_k), or per token ([T] int64)
        # inside tokens_with_experts; `expert_mass`: the plan's share of routing weight.
        self.experts_per_token: int | None = None
        self.token_experts: torch.Tensor | None = None
        self.expert_mass: float | None = None
        self._register()

    def _register(self) -> None:
        self.layer_key = id(self)
        _LAYERS[self.layer_key] = self

    def __setstate__(self, state: dict) -> None:  # a deep copy or an unpickled layer: its own key
        super().__setstate__(state)
        self._register()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D]
        weights, expert_ids = self.route(x)  # [T, top_k]
        if self.expert_counts is not None:
            torch.ops.zcode.expert_lookup(self.expert_counts, expert_ids, x, self.layer_key)
        return self.run_experts(x, weights, expert_ids)

    def route(self, x: torch.Tensor, hooks: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's choice under the plan's expert limit: x [T, D] -> weights, expert ids
        [T, top_k] (a dropped expert: id -1, weight 0). `hooks=False`: a guess (the expert
        cache's read-ahead), which hooks that watch routing must not see."""
        weights, expert_ids = self.gate(x) if hooks else self.gate.forward(x)
        count = self.token_experts if self.token_experts is not None else self.experts_per_token
        if count is None and self.expert_mass is None:
            return weights, expert_ids
        renormalize = self.gate.norm_topk_prob
        return limit_experts(weights, expert_ids, count, self.expert_mass, renormalize)

    def run_experts(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts (expert_ids index `self.experts`, -1: not held here) plus the
        shared one: x [T, D], weights / expert_ids [T, top_k] -> [T, D]."""
        if torch.compiler.is_compiling():  # traced once per graph; dynamo guards the modules
            if (lists := self.fused_weights(x)) is not None:
                return torch.ops.zcode.moe_fused(x, weights, expert_ids, *lists, 1)
            if (stacked := self._traced_gguf_stacks()) is not None:
                out = torch.ops.zcode.ggml_moe(x, weights, expert_ids, *stacked, len(self.experts))
                return out.to(x.dtype)
            # the other paths run outside the graph, as at eager
            return torch.ops.zcode.moe_eager(x, weights, expert_ids, self.layer_key)
        fused, gguf = self._step_lists(x)
        if fused is not None:
            return torch.ops.zcode.moe_fused(x, weights, expert_ids, *fused, 1)
        if gguf is not None:
            out = torch.ops.zcode.ggml_moe(x, weights, expert_ids, *gguf, len(self.experts))
            return out.to(x.dtype)
        return self.routed_by_module(x, weights, expert_ids) + self.shared_experts(x)

    def fused_weights(self, x: torch.Tensor) -> tuple[list, list, list] | None:
        """(gate, up, down) weight lists, routed experts then the shared one, when the C++ op
        runs this step: a swapped module or a hook (calibration expects its module's own calls)
        sends the step to the modules."""
        if torch.compiler.is_compiling():
            if not self._fused_runs(x) or not _all_gated_mlps(mlps := self._mlps()):
                return None
            return self._gather(tuple((m.gate_proj, m.up_proj, m.down_proj) for m in mlps), x.dtype)
        return self._step_lists(x)[0]

    def ggml_lists(self, x: torch.Tensor) -> tuple | None:
        """The lists `run_experts` passes to ggml_moe for a step on x (GGUF experts on their
        kernels; compiled: as gathered at the last eager step), or None where it runs another
        path."""
        if torch.compiler.is_compiling():
            return None if self.fused_weights(x) is not None else self._traced_gguf_stacks()
        fused, gguf = self._step_lists(x)
        return gguf if fused is None else None

    def _traced_gguf_stacks(self) -> tuple | None:
        """ggml_moe's lists as gathered at the last eager step or `gather_weights`, where they
        hold the routed experts as stacks (their tensors are the stack attributes and the shared
        expert's buffers, which DirectStep finds), or None."""
        if self.gguf_gate_stack is None or not ggml_available():
            return None
        return self._gguf_weights

    def gather_weights(self) -> None:
        """Gathers the experts' weight lists again if a module was swapped (ModelRunner.set_plan
        calls it before compiled steps re-read the model's tensors)."""
        mlps = self._mlps()
        if _all_gated_mlps(mlps):
            weight = getattr(mlps[0].gate_proj, "weight", None)  # float experts: their dtype
            self._weight_lists(mlps, None if weight is None else weight.dtype)

    def gguf_weights(self, x: torch.Tensor) -> tuple | None:
        """(gate, up, down data lists, then their ggml kernel types), routed experts then the
        shared one, when every projection is a GGUF weight on its C++ kernel
        (`torch.ops.zcode.ggml_moe`); gathered once per set of modules, as fused_weights."""
        return self._step_lists(x)[1]

    def _step_lists(self, x: torch.Tensor) -> tuple:
        """(fused_weights, gguf_weights) for a step on x, the experts' modules walked once."""
        if x.device.type != "cpu" or not _all_gated_mlps(mlps := self._mlps()):
            return None, None
        fused, gguf = self._weight_lists(mlps, x.dtype)
        if fused is not None and not (
            self._fused_runs(x)
            and fused[0][0].dtype == x.dtype
            and not (fused[0][0].requires_grad and torch.is_grad_enabled())  # no backward
        ):
            fused = None
        return fused, gguf if ggml_available() else None

    @staticmethod
    def _fused_runs(x: torch.Tensor) -> bool:
        return x.dtype in FUSED_DTYPES and x.device.type == "cpu" and _fused_available()

    def _mlps(self) -> tuple:
        return (*self.experts, self.shared_experts)

    def _weight_lists(self, mlps: tuple, dtype: torch.dtype) -> tuple:
        """(float lists for moe_fused, GGUF lists for ggml_moe), each None where the experts'
        projections are not all of that kind, both None while any module has a hook; gathered
        again only when a module was swapped (compared in C, ~20 us at 128 experts)."""
        projections = tuple(map(_PROJECTIONS, map(_SUBMODULES, mlps)))
        if projections != self._projections:
            self._projections = projections
            self._fused_weights = self._gather(projections, dtype)
            self._gguf_weights = _gguf_lists(projections)
            stacks = self._gguf_weights and [entries[0] for entries in self._gguf_weights[:3]]
            if not stacks or any(stack.dim() != 3 for stack in stacks):
                stacks = [None] * 3
            self.gguf_gate_stack, self.gguf_up_stack, self.gguf_down_stack = stacks
            modules = itertools.chain(mlps, itertools.chain.from_iterable(projections))
            self._hook_dicts = list(itertools.chain.from_iterable(map(_HOOKS, modules)))
        if any(self._hook_dicts):
            return None, None
        return self._fused_weights, self._gguf_weights

    @staticmethod
    def _gather(projections: tuple, dtype: torch.dtype) -> tuple[list, list, list] | None:
        linears = [p for trio in projections for p in trio]
        if not all(
            type(p) is Linear
            and p.bias is None
            and p.weight.dtype == dtype
            and p.weight.device.type == "cpu"
            and p.weight.is_contiguous()
            for p in linears
        ):
            return None
        gate, up, down = ([trio[i].weight for trio in projections] for i in range(3))
        return gate, up, down

    def routed_by_module(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """The routed experts through their own modules, any weight format: [T, D]."""
        mlps = tuple(self.experts)
        if (
            x.shape[0] <= GEMV_MAX_ROWS
            and _all_gated_mlps(mlps)
            and not _hooked(mlps, tuple(map(_PROJECTIONS, map(_SUBMODULES, mlps))))
        ):
            return self._routed_decode(x, weights, expert_ids)
        # Tokens sorted by expert once; each expert runs on its contiguous slice. Ids shifted by
        # one so the assignments to experts not held here (-1) sort first, and are dropped.
        top_k = expert_ids.shape[1]
        shifted = expert_ids.flatten() + 1
        order = shifted.argsort(stable=True)
        num_skipped, *counts = torch.bincount(shifted, minlength=len(self.experts) + 1).tolist()
        order = order[num_skipped:]
        token_ids = order // top_k
        rows = x[token_ids]  # [T * k, D], grouped by expert
        out_rows = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, counts):
            if count:
                out_rows[start : start + count] = expert(rows[start : start + count])
                start += count
        out_rows.mul_(weights.flatten()[order, None].to(x.dtype))
        return torch.zeros_like(x).index_add_(0, token_ids, out_rows)

    def _routed_decode(
        self, x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor
    ) -> torch.Tensor:
        """A few tokens: every token through the union of their experts (the same weight bytes
        as each expert on its own tokens), gate/up of all of them in one group call, each
        expert's output weighted by its routing weight per token (0 where not routed)."""
        active = [e for e in expert_ids.unique().tolist() if e >= 0]  # -1: not held here
        if not active:
            return torch.zeros_like(x)
        mlps = [self.experts[e] for e in active]
        gate_up = linear_group(x, [p for m in mlps for p in (m.gate_proj, m.up_proj)])
        dense = torch.zeros(x.shape[0], len(self.experts) + 1, dtype=torch.float32)
        dense.scatter_(1, expert_ids + 1, weights.float())  # column 0: the skipped ones
        gains = dense[:, [e + 1 for e in active]].to(x.dtype)  # [T, A]
        out = torch.zeros_like(x)
        for i, m in enumerate(mlps):
            act = m.activation(gate_up[2 * i]) * gate_up[2 * i + 1]
            out.addcmul_(m.down_proj(act), gains[:, i : i + 1])
        return out


def limit_experts(
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    count: int | torch.Tensor | None = None,
    mass: float | None = None,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed experts in the router's order of preference (first the one it prefers most): each
    token keeps its first `count` (an int, or [T]), and of those only as many as reach `mass` of
    its routing weight (at least one); the others get id -1 and weight 0. `renormalize`: the
    kept weights are rescaled to the row's full total (a router that normalizes its top-k)."""
    # weights: [T, K] >= 0, expert_ids: [T, K] -> both [T, K]
    rank = torch.arange(weights.shape[-1], device=weights.device)
    keep = torch.ones_like(weights, dtype=torch.bool)
    if count is not None:
        keep &= rank < torch.as_tensor(count, device=weights.device).reshape(-1, 1).clamp(min=1)
    if mass is not None:
        before = weights.cumsum(-1) - weights  # weight of the experts ranked above
        keep &= (before < mass * weights.sum(-1, keepdim=True)) | (rank == 0)
    kept = weights * keep
    if renormalize:
        total = weights.sum(-1, keepdim=True)
        kept = kept * (total / kept.sum(-1, keepdim=True).clamp(min=1e-20))
    return kept, expert_ids.masked_fill(~keep, -1)


@contextlib.contextmanager
def tokens_with_experts(moes: list["MoE"], counts: torch.Tensor):
    """Inside, each of `moes` runs each token's own number of routed experts: counts [T] for
    the next forward's T tokens (a count >= top_k runs all)."""
    try:
        for moe in moes:
            moe.token_experts = counts
        yield
    finally:
        for moe in moes:
            moe.token_experts = None


def set_experts_per_token(model: nn.Module, count: int | None, mass: float | None = None) -> None:
    """Every MoE layer of `model` runs `count` routed experts per token (None: its router's
    top_k), up to `mass` of each token's routing weight (None: all of them)."""
    if count is not None and count < 1:
        raise ValueError(f"experts per token must be >= 1, got {count}")
    if mass is not None and not 0.0 < mass <= 1.0:
        raise ValueError(f"expert mass must be in (0, 1], got {mass}")
    for moe in moe_layers(model):
        moe.experts_per_token = None if count is None or count >= moe.gate.top_k else count
        moe.expert_mass = None if mass is None or mass >= 1.0 else mass


def moe_layers(model: nn.Module) -> list["MoE"]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def _all_gated_mlps(mlps: tuple) -> bool:
    """Whether every expert is a plain GatedMLP (SiLU, gate/up/down): what the fused paths run;
    any other module (a swapped-in expert of another kind) runs its own forward."""
    if torch.compiler.is_compiling():
        return all(type(m) is GatedMLP for m in mlps)
    return set(map(type, mlps)) == {GatedMLP}  # in C: ~3 us at 128 experts


def _hooked(mlps: tuple, projections: tuple) -> bool:
    """Whether any of these experts or their projections has a forward hook (in C: map/chain)."""
    modules = itertools.chain(mlps, itertools.chain.from_iterable(projections))
    return any(itertools.chain.from_iterable(map(_HOOKS, modules)))


def _gguf_lists(projections: tuple) -> tuple | None:
    """The projections' GGUF rows as ggml_moe takes them (the routed experts' as one stack per
    projection where each projection's lie in one stacked tensor of the file, then the shared
    expert's; else one matrix per expert), or None unless every one is a QuantizedLinear of a
    GgufWeight on its C++ kernel, without bias."""
    linears = [p for trio in projections for p in trio]
    if not all(
        isinstance(p, QuantizedLinear)
        and p.kernel == "fast"
        and p.bias is None
        and type(p.packed) is GgufWeight
        and has_kernel(p.packed.ggml_type)
        for p in linears
    ):
        return None
    packed = [[trio[i].packed for trio in projections] for i in range(3)]  # gate, up, down
    stacks = [_stack([p.data for p in weights[:-1]]) for weights in packed]
    if all(s is not None for s in stacks) and all(
        len({p.kernel_type for p in w[:-1]}) == 1 for w in packed
    ):
        data = ([stack, weights[-1].data] for stack, weights in zip(stacks, packed))
        types = ([weights[0].kernel_type, weights[-1].kernel_type] for weights in packed)
    else:
        data = ([p.data for p in weights] for weights in packed)
        types = ([p.kernel_type for p in weights] for weights in packed)
    return (*data, *types)


def _stack(rows: list[torch.Tensor]) -> torch.Tensor | None:
    """The matrices `rows` as one [E, N, row_bytes] view where they lie evenly spaced in one
    storage (the experts of a file's stacked tensor), else None."""
    first = rows[0]
    if len(rows) < 2 or any(r.shape != first.shape or r.stride() != first.stride() for r in rows):
        return None
    storage = first.untyped_storage().data_ptr()
    step = rows[1].data_ptr() - first.data_ptr()
    if step <= 0 or any(
        r.untyped_storage().data_ptr() != storage or r.data_ptr() != first.data_ptr() + e * step
        for e, r in enumerate(rows)
    ):
        return None
    return first.as_strided((len(rows), *first.shape), (step, *first.stride()))


# Compiled graphs name a MoE layer by key (an opaque op takes no module): id -> layer.
_LAYERS: weakref.WeakValueDictionary[int, MoE] = weakref.WeakValueDictionary()


@torch.library.custom_op("zcode::moe_eager", mutates_args=())
def _moe_eager(
    x: torch.Tensor, weights: torch.Tensor, expert_ids: torch.Tensor, layer: int
) -> torch.Tensor:
    """A compiled graph's call of a layer's experts, routed and shared, run as at eager."""
    return _LAYERS[layer].run_experts(x, weights, expert_ids)


@_moe_eager.register_fake
def _(x, weights, expert_ids, layer):
    return torch.empty_like(x)


@torch.compiler.assume_constant_result  # compiled graphs take the answer, not the build
def _fused_available() -> bool:
    from zcode.kernels.moe import fused_available  # zcode.kernels.moe imports this module

    return fused_available()

"""MoE ops (GLM-4.5+, GLM-5): `moe_routing`, the sigmoid router with e_score_correction_bias and
group-limited top-k, and `moe_experts`, the routed SwiGLU experts over stacked expert weights.

References: zcode.layers.moe.TopkRouter itself, and MoE.forward's loop (one expert at a time over
the tokens routed to it, weighted, summed with index_add_). The router's output is returned
sorted by expert id per token, so variants are compared as sets. CPU variants of `moe_experts`:
`sorted` permutes the tokens once by expert (a stable sort of the flat assignments) and runs each
expert on one contiguous slice, instead of a torch.where scan per expert; `fused` is the C++ op
below, one call for the whole layer.

`torch.ops.zcode.moe_fused(x, weights, expert_ids, w_gate, w_up, w_down, num_shared)` (moe.cpp:
AVX-512 BF16, or portable loops elsewhere): fp32 or bf16 expert weights as lists, one tensor per
expert (zero-copy views of the experts' Linear weights, so a module swap or a memory-mapped file
needs no restacking), the last `num_shared` experts applied to every token with weight 1; an
expert id of -1 is an assignment this call skips (expert parallelism: another rank's expert).
Experts hit by few tokens (decode) are GEMV passes, all in two parallel regions (gate/up rows with
SiLU-mul, then output columns with the weighted sum); experts hit by many (prefill) a GEMM per
projection. No host sync, no Python per expert; its fake kernel lets a compiled decode graph call
it.
"""

import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from zcode.kernels.cpp_build import build_ops
from zcode.kernels.registry import define_op, register
from zcode.layers.moe import TopkRouter

SOURCE = Path(__file__).with_name("moe.cpp")

# (tokens, hidden, experts, top_k, groups, top groups)
ROUTING_SHAPES = ((1, 64, 8, 2, 2, 1), (7, 48, 16, 4, 4, 2), (33, 32, 64, 6, 8, 3))


# --- routing ---------------------------------------------------------------------------------


def routing_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, D]; weight: [E, D]; bias: [E] -> (weights [T, k] fp32, expert ids [T, k]),
    sorted by expert id."""
    num_experts, hidden = weight.shape
    router = TopkRouter(
        hidden, num_experts, top_k, num_groups, topk_groups, norm_topk_prob, scaling
    )
    with torch.no_grad():
        router.weight.copy_(weight)
        router.e_score_correction_bias.copy_(bias)
    weights, ids = router.to(x.device)(x)
    return sort_by_expert(weights, ids)


def sort_by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids


def routing_shape_class(x, weight, bias, top_k, num_groups, *args) -> str:
    rows = "1" if x.shape[0] == 1 else "<=64" if x.shape[0] <= 64 else "many"
    return f"E{weight.shape[0]}xG{num_groups}xk{top_k}|rows{rows}"


def routing_cases() -> list:
    def case(tokens, hidden, experts, top_k, groups, top_groups):
        def make(generator: torch.Generator):
            x = torch.randn(tokens, hidden, generator=generator)
            weight = torch.randn(experts, hidden, generator=generator) * hidden**-0.5
            bias = torch.randn(experts, generator=generator) * 0.1
            return x, weight, bias, top_k, groups, top_groups, True, 2.5

        return f"T{tokens}-E{experts}-k{top_k}-G{groups}-top{top_groups}", make

    return [case(*shape) for shape in ROUTING_SHAPES]


define_op("moe_routing", routing_reference, routing_shape_class, routing_cases)


# --- experts ---------------------------------------------------------------------------------


def experts_reference(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_ids: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """x: [T, D]; weights, expert_ids: [T, k]; w_gate, w_up: [E, I, D]; w_down: [E, D, I]
    -> the weighted sum of each token's routed experts, [T, D]."""
    out = torch.zeros_like(x)
    for expert_id in expert_ids.unique().tolist():
        token_ids, slot = torch.where(expert_ids == expert_id)
        h = x[token_ids]
        h = F.linear(
            F.silu(F.linear(h, w_gate[expert_id])) * F.linear(h, w_up[expert_id]), w_down[expert_id]
        )
        out.index_add_(0, token_ids, h * weights[token_ids, slot, None].to(x.dtype))
    return out


def experts_shape_class(x, weights, expert_ids, w_gate, w_up, w_down) -> str:
    rows = "1" if x.shape[0] == 1 else "<=64" if x.shape[0] <= 64 else "many"
    return f"E{w_gate.shape[0]}xI{w_gate.shape[1]}xD{x.shape[1]}|k{weights.shape[1]}|rows{rows}"


def experts_cases() -> list:
    def case(tokens, hidden, inter, experts, top_k):
        def make(generator: torch.Generator):
            x = torch.randn(tokens, hidden, generator=generator)
            scores = torch.rand(tokens, experts, generator=generator)
            weights, ids = scores.topk(top_k, dim=-1)
            w_gate, w_up = (
                torch.randn(experts, inter, hidden, generator=generator) * hidden**-0.5
                for _ in "gu"
            )
            w_down = torch.randn(experts, hidden, inter, generator=generator) * inter**-0.5
            return x, weights, ids, w_gate, w_up, w_down

        return f"T{tokens}-D{hidden}-I{inter}-E{experts}-k{top_k}", make

    return [case(1, 64, 32, 8, 2), case(9, 40, 24, 16, 4), case(37, 32, 17, 6, 3)]


define_op("moe_experts", experts_reference, experts_shape_class, experts_cases)


def permute_by_expert(
    expert_ids: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (token, slot) assignments grouped by expert: (order [T * k] into the flat
    assignments, offsets [E + 1] where expert e's rows are order[offsets[e]:offsets[e + 1]])."""
    flat = expert_ids.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64)
    offsets[1:] = counts.cumsum(0)
    return order, offsets


@register("moe_experts", "sorted")
def experts_sorted(x, weights, expert_ids, w_gate, w_up, w_down) -> torch.Tensor:
    top_k = expert_ids.shape[1]
    order, offsets = permute_by_expert(expert_ids, w_gate.shape[0])
    token_ids = order // top_k
    h = x[token_ids]  # [T * k, D], grouped by expert
    out_rows = torch.empty_like(h)
    bounds = offsets.tolist()
    for e, (start, end) in enumerate(zip(bounds[:-1], bounds[1:])):
        if start == end:
            continue
        rows = h[start:end]
        act = F.silu(F.linear(rows, w_gate[e])).mul_(F.linear(rows, w_up[e]))
        out_rows[start:end] = F.linear(act, w_down[e])
    out_rows.mul_(weights.flatten()[order, None].to(x.dtype))
    return torch.zeros_like(x).index_add_(0, token_ids, out_rows)


def fused_supports(x, weights, expert_ids, w_gate, w_up, w_down) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and w_gate.dtype == x.dtype
        and fused_available()
    )


@register("moe_experts", "fused", supports=fused_supports)
def experts_fused(x, weights, expert_ids, w_gate, w_up, w_down) -> torch.Tensor:
    lists = [list(w.contiguous().unbind(0)) for w in (w_gate, w_up, w_down)]
    return torch.ops.zcode.moe_fused(x, weights, expert_ids, *lists, 0)


@torch.compiler.assume_constant_result  # compiled graphs take the answer, not the build
def fused_available() -> bool:
    """True when moe.cpp builds and loads here (built on first call); then torch.ops.zcode has
    moe_fused."""
    return _load()


@functools.cache
def _load() -> bool:
    if not build_ops("zcode_moe", SOURCE, "using the expert loop"):
        return False

    # Output shape for tracing (torch.compile): the kernel itself never runs on fakes.
    @torch.library.register_fake("zcode::moe_fused")
    def _(x, weights, expert_ids, w_gate, w_up, w_down, num_shared):
        return torch.empty_like(x)

    return True

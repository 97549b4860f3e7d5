"""Triton MoE kernels: the noaux_tc router (GEMM, sigmoid, bias-corrected group top-k, weights)
in one program per token, and the routed experts as a grouped GEMM over tokens permuted by
expert (the gather of each expert's tokens fused into the gate/up GEMM's loads).
"""

import torch
import triton
import triton.language as tl

from zcode.kernels.moe import permute_by_expert
from zcode.kernels.triton.common import dot_dtype, gemm_blocks


@triton.jit
def _routing_kernel(
    x_ptr, w_ptr, bias_ptr, out_w_ptr, out_ids_ptr, hidden, num_experts, scaling,
    BLOCK_E: tl.constexpr, BLOCK_D: tl.constexpr, NUM_GROUPS: tl.constexpr,
    TOPK_GROUPS: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    experts = tl.arange(0, BLOCK_E)
    valid = experts < num_experts
    logits = tl.zeros([BLOCK_E], dtype=tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        dims = d0 + tl.arange(0, BLOCK_D)
        x = tl.load(x_ptr + t * hidden + dims, mask=dims < hidden, other=0.0).to(tl.float32)
        w = tl.load(
            w_ptr + experts[:, None] * hidden + dims[None, :],
            mask=valid[:, None] & (dims[None, :] < hidden),
            other=0.0,
        ).to(tl.float32)
        logits += tl.sum(w * x[None, :], axis=1)
    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + experts, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, scores + bias, float("-inf"))
    if NUM_GROUPS > 1:
        # group score = sum of the group's two best corrected scores; keep the TOPK_GROUPS best
        per_group: tl.constexpr = BLOCK_E // NUM_GROUPS
        grouped = tl.reshape(choice, (NUM_GROUPS, per_group))
        first = tl.max(grouped, axis=1)
        first_at = tl.argmax(grouped, axis=1)
        members = tl.arange(0, per_group)
        rest = tl.where(members[None, :] == first_at[:, None], float("-inf"), grouped)
        group_scores = first + tl.max(rest, axis=1)
        groups = tl.arange(0, NUM_GROUPS)
        keep_group = groups < 0
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.argmax(group_scores, axis=0)
            keep_group = keep_group | (groups == best)
            group_scores = tl.where(groups == best, float("-inf"), group_scores)
        in_kept = (experts[:, None] // per_group == groups[None, :]) & keep_group[None, :]
        choice = tl.where(tl.max(in_kept.to(tl.int32), axis=1) > 0, choice, float("-inf"))
    selected = experts < 0
    for _ in tl.static_range(TOP_K):
        best = tl.argmax(choice, axis=0)
        selected = selected | (experts == best)
        choice = tl.where(experts == best, float("-inf"), choice)
    weights = tl.where(selected, scores, 0.0)
    if NORM:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    weights = weights * scaling
    slot = tl.cumsum(selected.to(tl.int32), axis=0) - 1  # ascending expert id order
    tl.store(out_ids_ptr + t * TOP_K + slot, experts.to(tl.int64), mask=selected)
    tl.store(out_w_ptr + t * TOP_K + slot, weights, mask=selected)


def routing(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    num_groups: int,
    topk_groups: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    # x: [T, D]; weight: [E, D] -> (weights [T, k] fp32, ids [T, k]) sorted by expert id
    num_tokens, hidden = x.shape
    num_experts = weight.shape[0]
    out_w = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    out_ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    _routing_kernel[(num_tokens,)](
        x.contiguous(), weight.contiguous(), bias.contiguous(), out_w, out_ids, hidden,
        num_experts, float(scaling),
        BLOCK_E=triton.next_power_of_2(num_experts), BLOCK_D=64, NUM_GROUPS=num_groups,
        TOPK_GROUPS=topk_groups, TOP_K=top_k, NORM=bool(norm_topk_prob),
    )  # fmt: skip
    return out_w, out_ids


def routing_supported(x, weight, bias, top_k, num_groups, *args) -> bool:
    """Groups must tile the power-of-two expert block evenly."""
    num_experts = weight.shape[0]
    if num_groups == 1:
        return True
    per_group = num_experts // num_groups
    return num_experts == triton.next_power_of_2(num_experts) and per_group >= 2


@triton.jit
def _gate_up_kernel(
    x_ptr, token_ids_ptr, offsets_ptr, active_ptr, wg_ptr, wu_ptr, act_ptr, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """act[r] = silu(x[token(r)] @ Wg[e].T) * (x[token(r)] @ Wu[e].T) for expert e's rows r."""
    e = tl.load(active_ptr + tl.program_id(0))  # int64: E * I * D passes 2**31 at GLM-5 sizes
    m_block, n_block = tl.program_id(1), tl.program_id(2)
    start, end = tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1)
    rows = start + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + m_block * BLOCK_M < end:
        row_ok = rows < end
        tokens = tl.load(token_ids_ptr + rows, mask=row_ok, other=0)
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(
                x_ptr + tokens[:, None] * hidden + ks[None, :],
                mask=row_ok[:, None] & (ks[None, :] < hidden),
                other=0.0,
            ).to(COMPUTE)
            w_offsets = e * inter * hidden + cols[None, :] * hidden + ks[:, None]  # [K, N]
            w_mask = (cols[None, :] < inter) & (ks[:, None] < hidden)
            w_gate = tl.load(wg_ptr + w_offsets, mask=w_mask, other=0.0).to(COMPUTE)
            w_up = tl.load(wu_ptr + w_offsets, mask=w_mask, other=0.0).to(COMPUTE)
            gate += tl.dot(x, w_gate, input_precision=PRECISION)
            up += tl.dot(x, w_up, input_precision=PRECISION)
        act = gate * tl.sigmoid(gate) * up
        tl.store(
            act_ptr + rows[:, None] * inter + cols[None, :],
            act,
            mask=row_ok[:, None] & (cols[None, :] < inter),
        )


@triton.jit
def _down_kernel(
    act_ptr, offsets_ptr, active_ptr, wd_ptr, row_w_ptr, out_ptr, hidden, inter,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[r] = route_weight[r] * act[r] @ Wd[e].T for expert e's rows r."""
    e = tl.load(active_ptr + tl.program_id(0))
    m_block, n_block = tl.program_id(1), tl.program_id(2)
    start, end = tl.load(offsets_ptr + e), tl.load(offsets_ptr + e + 1)
    rows = start + m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    if start + m_block * BLOCK_M < end:
        row_ok = rows < end
        cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            act = tl.load(
                act_ptr + rows[:, None] * inter + ks[None, :],
                mask=row_ok[:, None] & (ks[None, :] < inter),
                other=0.0,
            ).to(COMPUTE)
            w = tl.load(
                wd_ptr + e * hidden * inter + cols[None, :] * inter + ks[:, None],
                mask=(cols[None, :] < hidden) & (ks[:, None] < inter),
                other=0.0,
            ).to(COMPUTE)
            acc += tl.dot(act, w, input_precision=PRECISION)
        route_w = tl.load(row_w_ptr + rows, mask=row_ok, other=0.0)
        tl.store(
            out_ptr + rows[:, None] * hidden + cols[None, :],
            acc * route_w[:, None],
            mask=row_ok[:, None] & (cols[None, :] < hidden),
        )


def experts(x, weights, expert_ids, w_gate, w_up, w_down) -> torch.Tensor:
    # x: [T, D]; weights, expert_ids: [T, k]; w_gate, w_up: [E, I, D]; w_down: [E, D, I]
    num_experts, inter, hidden = w_gate.shape
    top_k = expert_ids.shape[1]
    order, offsets = permute_by_expert(expert_ids.cpu(), num_experts)
    counts = offsets[1:] - offsets[:-1]
    active = counts.nonzero().flatten()  # a program grid over the experts this step routes to
    block_m, block_n, block_k = gemm_blocks(int(counts.max()))
    max_blocks = triton.cdiv(int(counts.max()), block_m)
    order, offsets, active = (t.to(x.device) for t in (order, offsets, active))
    token_ids = order // top_k  # [T * k] rows grouped by expert
    row_weights = weights.flatten()[order].float().contiguous()
    num_rows = token_ids.numel()
    dot = dot_dtype(w_gate)
    act = torch.empty(num_rows, inter, dtype=torch.float32, device=x.device)
    _gate_up_kernel[(active.numel(), max_blocks, triton.cdiv(inter, block_n))](
        x.contiguous(), token_ids, offsets, active, w_gate.contiguous(), w_up.contiguous(), act,
        hidden, inter, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot,
    )  # fmt: skip
    rows_out = torch.empty(num_rows, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(active.numel(), max_blocks, triton.cdiv(hidden, block_n))](
        act, offsets, active, w_down.contiguous(), row_weights, rows_out, hidden, inter,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot,
    )  # fmt: skip
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    return out.index_add_(0, token_ids, rows_out).to(x.dtype)

"""Triton MoE kernels: the noaux_tc router (GEMM, sigmoid, bias-corrected group top-k, weights)
in one program per token, and the routed experts in two shapes:

- decode (few (token, expert) rows): GEMVs, one program per (row, block of outputs, split of the
  reduced dim), each streaming [BLOCK_N, BLOCK_K] weight tiles contiguous along K; gate and up in
  the same program, their split partial sums added in fp32 atomically; the down GEMV computes
  silu(gate) * up as it loads it and adds its routing-weighted rows into the output atomically.
  No host sync (the rows are sorted by expert on the device), so a CUDA graph can hold it;
- prefill: a grouped GEMM over tokens permuted by expert (the gather of each expert's tokens fused
  into the gate/up GEMM's loads).
"""

from dataclasses import dataclass

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


# At most this many (token, expert) rows take the decode GEMVs: each row reads its expert's
# weights once (rows of one expert share them through L2), where the grouped GEMM reads each hit
# expert once for all its rows. bench/bench_triton_gpu.py times both paths at 1-16 tokens: on an
# H200 (GLM-4.5-Air, top-8, swept tiles) the GEMVs still lead at 16 tokens, 0.84 ms against 1.04.
DECODE_MAX_ROWS = 128


@dataclass(frozen=True)
class GemvTiles:
    """One decode GEMV's work split: BLOCK_N outputs per program, the reduced dim in loads of
    BLOCK_K contiguous elements, cut into `split_k` spans summed by fp32 atomic adds."""

    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4


@dataclass(frozen=True)
class DecodeTiles:
    gate_up: GemvTiles
    down: GemvTiles


# From bench_triton_gpu.py --sweep on an H200 (GLM-4.5-Air bf16, CUDA graph): gate/up at
# (8, 512, split 4, 2 warps) 0.093 ms at 1 token (2990 GB/s) and 0.47 ms at 8 (3770 GB/s) against
# 0.110 / 0.54 for (32, 256, 4, 4 warps); the down tiles tried lie within 6%, but (128, 128, 1).
DECODE_TILES = DecodeTiles(GemvTiles(8, 512, 4, num_warps=2), GemvTiles(32, 128, 2))


def experts(x, weights, expert_ids, w_gate, w_up, w_down) -> torch.Tensor:
    # x: [T, D]; weights, expert_ids: [T, k]; w_gate, w_up: [E, I, D]; w_down: [E, D, I]
    if expert_ids.numel() <= DECODE_MAX_ROWS:
        return experts_decode(x, weights, expert_ids, w_gate, w_up, w_down)
    return experts_grouped(x, weights, expert_ids, w_gate, w_up, w_down)


@triton.jit
def _gate_up_gemv_kernel(
    x_ptr, token_ids_ptr, row_experts_ptr, wg_ptr, wu_ptr, gate_up_ptr, hidden, inter,
    k_steps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """gate_up[r] += (x[token(r)] . Wg[e(r)][n], x[token(r)] . Wu[e(r)][n]) over one K span."""
    r, n_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(row_experts_ptr + r)  # int64: E * I * D passes 2**31 at GLM-5 sizes
    token = tl.load(token_ids_ptr + r)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < inter
    w_rows = e * inter * hidden + cols[:, None] * hidden  # [N, 1]
    gate = tl.zeros([BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for step in range(0, k_steps):
        ks = (split * k_steps + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden
        x = tl.load(x_ptr + token * hidden + ks, mask=k_ok, other=0.0).to(tl.float32)
        w_mask = col_ok[:, None] & k_ok[None, :]
        w_gate = tl.load(wg_ptr + w_rows + ks[None, :], mask=w_mask, other=0.0)  # [N, K]
        w_up = tl.load(wu_ptr + w_rows + ks[None, :], mask=w_mask, other=0.0)
        gate += tl.sum(w_gate.to(tl.float32) * x[None, :], axis=1)
        up += tl.sum(w_up.to(tl.float32) * x[None, :], axis=1)
    tl.atomic_add(gate_up_ptr + r * 2 * inter + cols, gate, mask=col_ok)
    tl.atomic_add(gate_up_ptr + r * 2 * inter + inter + cols, up, mask=col_ok)


@triton.jit
def _down_gemv_kernel(
    gate_up_ptr, token_ids_ptr, row_experts_ptr, row_w_ptr, wd_ptr, out_ptr, hidden, inter,
    k_steps, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[token(r)] += route_weight[r] * (silu(gate[r]) * up[r]) @ Wd[e(r)].T over one K span."""
    r, n_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = tl.load(row_experts_ptr + r)
    token = tl.load(token_ids_ptr + r)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    w_rows = e * hidden * inter + cols[:, None] * inter  # [N, 1]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for step in range(0, k_steps):
        ks = (split * k_steps + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < inter
        gate = tl.load(gate_up_ptr + r * 2 * inter + ks, mask=k_ok, other=0.0)
        up = tl.load(gate_up_ptr + r * 2 * inter + inter + ks, mask=k_ok, other=0.0)
        act = gate * tl.sigmoid(gate) * up
        w = tl.load(wd_ptr + w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * act[None, :], axis=1)
    route_w = tl.load(row_w_ptr + r)
    tl.atomic_add(out_ptr + token * hidden + cols, acc * route_w, mask=col_ok)


def _gemv_grid(rows: int, outputs: int, reduced: int, tiles: GemvTiles) -> tuple[tuple, int]:
    """(grid, k_steps): the programs of a GEMV over `rows` rows and the BLOCK_K loads each makes,
    so that `split_k` programs cover `reduced` in whole tiles."""
    k_steps = triton.cdiv(triton.cdiv(reduced, tiles.block_k), tiles.split_k)
    return (rows, triton.cdiv(outputs, tiles.block_n), tiles.split_k), k_steps


def experts_decode(
    x, weights, expert_ids, w_gate, w_up, w_down, tiles: DecodeTiles = DECODE_TILES
) -> torch.Tensor:
    # x: [T, D]; weights, expert_ids: [T, k]; w_gate, w_up: [E, I, D]; w_down: [E, D, I]
    num_experts, inter, hidden = w_gate.shape
    top_k = expert_ids.shape[1]
    # rows of one expert side by side: their programs run together and share its tiles in L2
    row_experts, order = expert_ids.flatten().sort(stable=True)  # [T * k]
    token_ids = order // top_k
    row_weights = weights.flatten()[order].float().contiguous()
    num_rows = order.numel()
    gate_up = torch.zeros(num_rows, 2 * inter, dtype=torch.float32, device=x.device)
    grid, k_steps = _gemv_grid(num_rows, inter, hidden, tiles.gate_up)
    _gate_up_gemv_kernel[grid](
        x.contiguous(), token_ids, row_experts, w_gate.contiguous(), w_up.contiguous(), gate_up,
        hidden, inter, k_steps, BLOCK_N=tiles.gate_up.block_n, BLOCK_K=tiles.gate_up.block_k,
        num_warps=tiles.gate_up.num_warps,
    )  # fmt: skip
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, D]
    grid, k_steps = _gemv_grid(num_rows, hidden, inter, tiles.down)
    _down_gemv_kernel[grid](
        gate_up, token_ids, row_experts, row_weights, w_down.contiguous(), out, hidden, inter,
        k_steps, BLOCK_N=tiles.down.block_n, BLOCK_K=tiles.down.block_k,
        num_warps=tiles.down.num_warps,
    )  # fmt: skip
    return out.to(x.dtype)


def experts_grouped(
    x, weights, expert_ids, w_gate, w_up, w_down, blocks: tuple[int, int, int] | None = None
) -> torch.Tensor:
    # x: [T, D]; weights, expert_ids: [T, k]; w_gate, w_up: [E, I, D]; w_down: [E, D, I]
    num_experts, inter, hidden = w_gate.shape
    top_k = expert_ids.shape[1]
    order, offsets = permute_by_expert(expert_ids.cpu(), num_experts)
    counts = offsets[1:] - offsets[:-1]
    active = counts.nonzero().flatten()  # a program grid over the experts this step routes to
    block_m, block_n, block_k = blocks or gemm_blocks(int(counts.max()))
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

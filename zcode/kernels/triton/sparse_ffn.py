"""Triton fused sparse FFN: only the selected neurons' rows of gate/up and of down's transpose are
read, gathered by index inside the two GEMM kernels (no sliced weight copies); every gathered
weight is a contiguous row, so the loads are coalesced."""

import torch
import triton
import triton.language as tl

from zcode.kernels.triton.common import dot_dtype, gemm_blocks


@triton.jit
def _gate_up_kernel(
    x_ptr, wg_ptr, wu_ptr, ids_ptr, act_ptr, num_tokens, hidden, num_kept,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """act[t, j] = silu(x[t] . Wg[ids[j]]) * (x[t] . Wu[ids[j]])."""
    m_block, n_block = tl.program_id(0), tl.program_id(1)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < num_kept
    neurons = tl.load(ids_ptr + cols, mask=col_ok, other=0)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rows[:, None] * hidden + ks[None, :],
            mask=(rows[:, None] < num_tokens) & (ks[None, :] < hidden),
            other=0.0,
        ).to(COMPUTE)
        w_offsets = neurons[None, :] * hidden + ks[:, None]  # [K, N]: rows of W, transposed
        w_mask = col_ok[None, :] & (ks[:, None] < hidden)
        w_gate = tl.load(wg_ptr + w_offsets, mask=w_mask, other=0.0).to(COMPUTE)
        w_up = tl.load(wu_ptr + w_offsets, mask=w_mask, other=0.0).to(COMPUTE)
        gate += tl.dot(x, w_gate, input_precision=PRECISION)
        up += tl.dot(x, w_up, input_precision=PRECISION)
    tl.store(
        act_ptr + rows[:, None] * num_kept + cols[None, :],
        gate * tl.sigmoid(gate) * up,
        mask=(rows[:, None] < num_tokens) & col_ok[None, :],
    )


@triton.jit
def _down_kernel(
    act_ptr, wd_t_ptr, ids_ptr, out_ptr, num_tokens, hidden, num_kept,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[t, d] = sum_j act[t, j] * Wd_t[ids[j], d]."""
    m_block, n_block = tl.program_id(0), tl.program_id(1)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, num_kept, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < num_kept
        neurons = tl.load(ids_ptr + ks, mask=k_ok, other=0)
        act = tl.load(
            act_ptr + rows[:, None] * num_kept + ks[None, :],
            mask=(rows[:, None] < num_tokens) & k_ok[None, :],
            other=0.0,
        ).to(COMPUTE)
        w = tl.load(
            wd_t_ptr + neurons[:, None] * hidden + cols[None, :],  # [K, N]: rows of Wd_t
            mask=(cols[None, :] < hidden) & k_ok[:, None],
            other=0.0,
        ).to(COMPUTE)
        acc += tl.dot(act, w, input_precision=PRECISION)
    tl.store(
        out_ptr + rows[:, None] * hidden + cols[None, :],
        acc,
        mask=(rows[:, None] < num_tokens) & (cols[None, :] < hidden),
    )


def sparse_ffn(x, w_gate, w_up, w_down_t, neuron_ids) -> torch.Tensor:
    # x: [T, D]; w_gate, w_up, w_down_t: [I, D]; neuron_ids: [n] -> [T, D]
    num_tokens, hidden = x.shape
    num_kept = neuron_ids.numel()
    block_m, block_n, block_k = gemm_blocks(num_tokens)
    dot = dot_dtype(w_gate)
    act = torch.empty(num_tokens, num_kept, dtype=torch.float32, device=x.device)
    ids = neuron_ids.contiguous()
    _gate_up_kernel[(triton.cdiv(num_tokens, block_m), triton.cdiv(num_kept, block_n))](
        x.contiguous(), w_gate.contiguous(), w_up.contiguous(), ids, act, num_tokens, hidden,
        num_kept, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot,
    )  # fmt: skip
    out = torch.empty(num_tokens, hidden, dtype=torch.float32, device=x.device)
    _down_kernel[(triton.cdiv(num_tokens, block_m), triton.cdiv(hidden, block_n))](
        act, w_down_t.contiguous(), ids, out, num_tokens, hidden, num_kept,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot,
    )  # fmt: skip
    return out.to(x.dtype)

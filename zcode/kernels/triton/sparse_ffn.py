"""Triton fused sparse FFN: only the selected neurons' rows of gate/up and of down's transpose are
read, gathered by index inside the two GEMM kernels (no sliced weight copies); every gathered
weight is a contiguous row, so the loads are coalesced.

At decode a GEMM has a handful of row blocks, so each kernel also splits its reduced dim across
programs (partial sums added in fp32 atomically): the gate/up kernel adds into fp32 gate and up
buffers, and the down kernel computes silu(gate) * up as it loads them.
"""

import torch
import triton
import triton.language as tl

from zcode.kernels.triton.common import dot_dtype, gemm_blocks

# Programs to aim for per launch: ~4 per SM of a 132-SM H100 / H200.
TARGET_PROGRAMS = 512
MAX_SPLIT_K = 16


@triton.jit
def _gate_up_kernel(
    x_ptr, wg_ptr, wu_ptr, ids_ptr, gate_up_ptr, num_tokens, hidden, num_kept, k_steps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """gate_up[t, 0, j] += x[t] . Wg[ids[j]], gate_up[t, 1, j] += x[t] . Wu[ids[j]] over one
    span of the hidden dim."""
    m_block, n_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < num_kept
    neurons = tl.load(ids_ptr + cols, mask=col_ok, other=0)
    gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, k_steps):
        ks = (split * k_steps + step) * BLOCK_K + tl.arange(0, BLOCK_K)
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
    out = gate_up_ptr + rows[:, None] * 2 * num_kept + cols[None, :]
    out_mask = (rows[:, None] < num_tokens) & col_ok[None, :]
    tl.atomic_add(out, gate, mask=out_mask)
    tl.atomic_add(out + num_kept, up, mask=out_mask)


@triton.jit
def _down_kernel(
    gate_up_ptr, wd_t_ptr, ids_ptr, out_ptr, num_tokens, hidden, num_kept, k_steps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """out[t, d] += sum_j silu(gate[t, j]) * up[t, j] * Wd_t[ids[j], d] over one span of the
    selected neurons."""
    m_block, n_block, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for step in range(0, k_steps):
        ks = (split * k_steps + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < num_kept
        neurons = tl.load(ids_ptr + ks, mask=k_ok, other=0)
        act_offsets = rows[:, None] * 2 * num_kept + ks[None, :]
        act_mask = (rows[:, None] < num_tokens) & k_ok[None, :]
        gate = tl.load(gate_up_ptr + act_offsets, mask=act_mask, other=0.0)
        up = tl.load(gate_up_ptr + act_offsets + num_kept, mask=act_mask, other=0.0)
        act = (gate * tl.sigmoid(gate) * up).to(COMPUTE)
        w = tl.load(
            wd_t_ptr + neurons[:, None] * hidden + cols[None, :],  # [K, N]: rows of Wd_t
            mask=(cols[None, :] < hidden) & k_ok[:, None],
            other=0.0,
        ).to(COMPUTE)
        acc += tl.dot(act, w, input_precision=PRECISION)
    tl.atomic_add(
        out_ptr + rows[:, None] * hidden + cols[None, :],
        acc,
        mask=(rows[:, None] < num_tokens) & (cols[None, :] < hidden),
    )


def _split_grid(m_blocks: int, n_blocks: int, reduced: int, block_k: int) -> tuple[tuple, int]:
    """(grid, k_steps): the reduced dim cut into whole BLOCK_K tiles across enough programs to
    reach TARGET_PROGRAMS."""
    tiles = triton.cdiv(reduced, block_k)
    split_k = max(1, min(MAX_SPLIT_K, tiles, TARGET_PROGRAMS // (m_blocks * n_blocks)))
    k_steps = triton.cdiv(tiles, split_k)
    return (m_blocks, n_blocks, triton.cdiv(tiles, k_steps)), k_steps


def sparse_ffn(x, w_gate, w_up, w_down_t, neuron_ids) -> torch.Tensor:
    # x: [T, D]; w_gate, w_up, w_down_t: [I, D]; neuron_ids: [n] -> [T, D]
    num_tokens, hidden = x.shape
    num_kept = neuron_ids.numel()
    block_m, block_n, block_k = gemm_blocks(num_tokens)
    m_blocks = triton.cdiv(num_tokens, block_m)
    dot = dot_dtype(w_gate)
    gate_up = torch.zeros(num_tokens, 2, num_kept, dtype=torch.float32, device=x.device)
    ids = neuron_ids.contiguous()
    grid, k_steps = _split_grid(m_blocks, triton.cdiv(num_kept, block_n), hidden, block_k)
    _gate_up_kernel[grid](
        x.contiguous(), w_gate.contiguous(), w_up.contiguous(), ids, gate_up, num_tokens, hidden,
        num_kept, k_steps, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot,
    )  # fmt: skip
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=x.device)
    grid, k_steps = _split_grid(m_blocks, triton.cdiv(hidden, block_n), num_kept, block_k)
    _down_kernel[grid](
        gate_up, w_down_t.contiguous(), ids, out, num_tokens, hidden, num_kept, k_steps,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, **dot,
    )  # fmt: skip
    return out.to(x.dtype)

"""Triton DSA kernels: the lightning indexer's scores over the paged index-key cache (keys
gathered by slot inside the kernel, all heads of a token at once), then top-k by torch.topk; and
sparse attention of each (token, head) over only its selected context positions, with an online
softmax over blocks of the selection.
"""

import torch
import triton
import triton.language as tl

from zcode.forward_batch import ForwardBatch
from zcode.kernels.dsa import _sorted_ids, token_seq_ids


@triton.jit
def _indexer_scores_kernel(
    q_ptr, cache_ptr, weights_ptr, slots_ptr, seq_ptr, pos_ptr, out_ptr,
    num_heads, head_dim, max_context, scale,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
):  # fmt: skip
    """out[t, l] = sum_h w[t, h] * relu(q[t, h] . key(slot[b, l])) * scale, -inf past the token."""
    t, l_block = tl.program_id(0), tl.program_id(1)
    b = tl.load(seq_ptr + t)
    position = tl.load(pos_ptr + t)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    ctx = l_block * BLOCK_L + tl.arange(0, BLOCK_L)
    ctx_ok = ctx < max_context
    q = tl.load(
        q_ptr + t * num_heads * head_dim + heads[:, None] * head_dim + dims[None, :],
        mask=(heads[:, None] < num_heads) & (dims[None, :] < head_dim),
        other=0.0,
    ).to(tl.float32)  # [H, D]
    slots = tl.load(slots_ptr + b * max_context + ctx, mask=ctx_ok, other=0)
    keys = tl.load(
        cache_ptr + slots[None, :] * head_dim + dims[:, None],
        mask=ctx_ok[None, :] & (dims[:, None] < head_dim),
        other=0.0,
    ).to(tl.float32)  # [D, L]
    # Full fp32 as the reference scores: tl.dot's tf32 default moves scores enough to swap ~8%
    # of a 2048-of-16384 selection at its boundary (seen on an H200).
    dots = tl.maximum(tl.dot(q, keys, input_precision="ieee"), 0.0) * scale  # [H, L]
    w = tl.load(weights_ptr + t * num_heads + heads, mask=heads < num_heads, other=0.0)
    scores = tl.sum(dots * w.to(tl.float32)[:, None], axis=0)  # [L]
    scores = tl.where(ctx <= position, scores, float("-inf"))
    tl.store(out_ptr + t * max_context + ctx, scores, mask=ctx_ok)


def indexer(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    head_weights: torch.Tensor,
    batch: ForwardBatch,
    topk: int,
) -> torch.Tensor:
    # q: [T, Hi, Di]; key_cache: [num_blocks, block_size, Di]; head_weights: [T, Hi] -> [T, K]
    num_tokens, num_heads, head_dim = q.shape
    max_context = batch.context_slots.shape[1]
    scores = torch.empty(num_tokens, max_context, dtype=torch.float32, device=q.device)
    block_l = 32
    _indexer_scores_kernel[(num_tokens, triton.cdiv(max_context, block_l))](
        q.contiguous(), key_cache.contiguous(), head_weights.contiguous(),
        batch.context_slots.contiguous(), token_seq_ids(batch), batch.positions, scores,
        num_heads, head_dim, max_context, head_dim**-0.5,
        BLOCK_H=max(16, triton.next_power_of_2(num_heads)),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_L=block_l,
    )  # fmt: skip
    values, ids = scores.topk(min(topk, max_context), dim=-1)
    return _sorted_ids(ids.masked_fill(values == float("-inf"), -1))


@triton.jit
def _sparse_attention_kernel(
    q_ptr, k_ptr, v_ptr, ids_ptr, seq_ptr, pos_ptr, out_ptr,
    num_heads, qk_dim, v_dim, num_selected, scale,
    stride_kb, stride_kl, stride_kh, stride_vb, stride_vl, stride_vh,
    BLOCK_K: tl.constexpr, BLOCK_DQK: tl.constexpr, BLOCK_DV: tl.constexpr,
):  # fmt: skip
    t, h = tl.program_id(0), tl.program_id(1)
    b = tl.load(seq_ptr + t)
    position = tl.load(pos_ptr + t)
    dqk = tl.arange(0, BLOCK_DQK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + (t * num_heads + h) * qk_dim + dqk, mask=dqk < qk_dim, other=0.0)
    q = q.to(tl.float32)
    running_max = float("-inf")
    running_sum = 0.0
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for k0 in range(0, num_selected, BLOCK_K):
        picks = k0 + tl.arange(0, BLOCK_K)
        ids = tl.load(ids_ptr + t * num_selected + picks, mask=picks < num_selected, other=-1)
        valid = (ids >= 0) & (ids <= position)
        safe = tl.where(valid, ids, 0)
        keys = tl.load(
            k_ptr + b * stride_kb + safe[:, None] * stride_kl + h * stride_kh + dqk[None, :],
            mask=valid[:, None] & (dqk[None, :] < qk_dim),
            other=0.0,
        ).to(tl.float32)  # [K, Dqk]
        scores = tl.where(valid, tl.sum(keys * q[None, :], axis=1) * scale, float("-inf"))
        block_max = tl.maximum(running_max, tl.max(scores, axis=0))
        # a block with nothing valid leaves the state as it is (exp(-inf - m) = 0)
        correction = tl.exp(running_max - block_max)
        probs = tl.exp(scores - block_max)
        values = tl.load(
            v_ptr + b * stride_vb + safe[:, None] * stride_vl + h * stride_vh + dv[None, :],
            mask=valid[:, None] & (dv[None, :] < v_dim),
            other=0.0,
        ).to(tl.float32)  # [K, Dv]
        acc = acc * correction + tl.sum(probs[:, None] * values, axis=0)
        running_sum = running_sum * correction + tl.sum(probs, axis=0)
        running_max = block_max
    tl.store(out_ptr + (t * num_heads + h) * v_dim + dv, acc / running_sum, mask=dv < v_dim)


def sparse_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: ForwardBatch,
    ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    # q: [T, H, Dk]; keys: [B, L, H, Dk]; values: [B, L, H, Dv]; ids: [T, K] -> [T, H, Dv]
    num_tokens, num_heads, qk_dim = q.shape
    v_dim = values.shape[-1]
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    values = values if values.stride(-1) == 1 else values.contiguous()
    out = torch.empty(num_tokens, num_heads, v_dim, dtype=torch.float32, device=q.device)
    _sparse_attention_kernel[(num_tokens, num_heads)](
        q.contiguous(), keys, values, ids.contiguous(), token_seq_ids(batch), batch.positions,
        out, num_heads, qk_dim, v_dim, ids.shape[1], float(scale),
        keys.stride(0), keys.stride(1), keys.stride(2),
        values.stride(0), values.stride(1), values.stride(2),
        BLOCK_K=16, BLOCK_DQK=triton.next_power_of_2(qk_dim),
        BLOCK_DV=triton.next_power_of_2(v_dim),
    )  # fmt: skip
    return out.to(q.dtype)

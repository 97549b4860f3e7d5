"""Grouped-query attention over the paged KV cache (Llama, GLM-4, GLM-4.5 MoE, Gemma 3)."""

import torch
import torch.nn.functional as F
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers.linear import Linear, linear_group
from zcode.layers.norm import RMSNorm
from zcode.layers.rotary import apply_rotary


def paged_attention_kernel():
    """zcode.kernels.paged_attention, imported on first use (zcode.kernels imports this module)."""
    from zcode.kernels import paged_attention

    return paged_attention


def write_cache(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # cache: [num_blocks, block_size, *shape]; values: [T, *shape]
    cache.view(-1, *cache.shape[2:])[slot_mapping] = values.to(cache.dtype)


def gather_cache(cache: torch.Tensor, context_slots: torch.Tensor) -> torch.Tensor:
    # cache: [num_blocks, block_size, *shape]; context_slots: [B, L] -> [B, L, *shape]
    # index_select copies whole slots; advanced indexing copies element by element, ~3x slower
    # (SmolLM2's KV of 150 positions: 24 -> 8 us a layer).
    slots = cache.view(-1, *cache.shape[2:])
    return slots.index_select(0, context_slots.flatten()).view(
        *context_slots.shape, *slots.shape[1:]
    )


def gather_head_pages(cache: torch.Tensor, context_slots: torch.Tensor) -> torch.Tensor:
    # cache: [num_pages, block_size, 2, 1, D]; context_slots: [B, L, KVH] -> [B, L, 2, KVH, D]
    return cache.view(-1, *cache.shape[2:])[context_slots][:, :, :, :, 0].movedim(2, 3)


def with_new_tokens(kv: torch.Tensor, kv_new: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """kv: [B, L, *shape] gathered context, stale where this step's tokens go; kv_new: [T, *shape]
    -> kv with each new token at its sequence's row and position."""
    num_seqs, max_context = kv.shape[:2]
    seq_of_token = batch.token_index // batch.query_index.shape[1]  # [T]
    rows = seq_of_token * max_context + batch.positions
    return kv.flatten(0, 1).index_copy(0, rows, kv_new.to(kv.dtype)).view_as(kv)


def padded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    batch: ForwardBatch,
    scale: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference attention of packed queries over gathered context.

    q: [T, H, Dk]; k: [B, L, KVH, Dk]; v: [B, L, KVH, Dv], q's dtype or a narrower KV cache
    dtype (widened exactly); mask: [B, 1 or H, S, L] bool or None (defaults to the batch's causal
    mask). Returns [T, H, Dv] in q's dtype.
    """
    if mask is None:
        mask = batch.attn_mask
    qp = q[batch.query_index].transpose(1, 2)  # [B, H, S, Dk]
    out = F.scaled_dot_product_attention(
        qp,
        k.transpose(1, 2).to(q.dtype),
        v.transpose(1, 2).to(q.dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=k.shape[2] != q.shape[1],
    )  # [B, H, S, Dv]
    num_seqs, num_heads, max_query, head_dim_v = out.shape
    out = out.transpose(1, 2).reshape(num_seqs * max_query, num_heads, head_dim_v)
    return out[batch.token_index]


def decode_attention(
    q: torch.Tensor, kv: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """A few queries per sequence (a decode or verifying step), written as products and sums
    for inductor to fuse: what a compiled step runs where the C++ kernel
    (zcode.kernels.paged_attention) does not, e.g. over KV paged per head.

    q: [B, S, H, D]; kv: [B, L, 2, KVH, D] (keys, values; q's dtype or a narrower KV cache
    dtype); mask: [B, 1, S, L] bool -> [B, S, H, D] in q's dtype. In a compiled step inductor
    turns the context gather, q.k, the softmax and p.v into a few loops of generated C++; SDPA
    is one extern call per layer whose set-up costs more than its arithmetic at these sizes
    (SmolLM2, 4 queries over ~250 positions: 72 us a layer). Same math as `padded_attention`,
    in fp32.
    """
    num_seqs, width, num_heads, head_dim = q.shape
    num_kv_heads, dtype = kv.shape[3], q.dtype
    group = num_heads // num_kv_heads
    q = q.float().view(num_seqs, width, 1, num_kv_heads, group, head_dim)
    keys = kv[:, None, :, 0, :, None, :].float()  # [B, 1, L, KVH, 1, D]
    scores = (q * keys).sum(-1) * scale  # [B, S, L, KVH, G]
    scores = scores.masked_fill(~mask.view(num_seqs, width, -1, 1, 1), float("-inf"))
    probs = scores.softmax(dim=2)[..., None]  # [B, S, L, KVH, G, 1]
    out = (probs * kv[:, None, :, 1, :, None, :].float()).sum(2)  # [B, S, KVH, G, D]
    return out.view(num_seqs, width, num_heads, head_dim).to(dtype)


class Attention(nn.Module):
    """Multi-head attention with GQA, optional partial RoPE, QK-norm, qkv bias and sliding
    window."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        interleaved_rope: bool = False,
        qkv_bias: bool = False,
        qk_norm_eps: float | None = None,
        qk_norm_unit_offset: bool = False,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        """scale: of the scores, default head_dim**-0.5; sliding_window: each query sees only
        itself and the sliding_window - 1 positions before it (None: the whole context)."""
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.interleaved_rope = interleaved_rope
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.q_proj = Linear(hidden_size, num_heads * head_dim, bias=qkv_bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=False)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=qk_norm_unit_offset)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, unit_offset=qk_norm_unit_offset)
        self.cache: dict[str, torch.Tensor] = {}

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        """Per-token shapes of what this layer keeps in the paged KV cache (K and V together,
        so a step writes and gathers once)."""
        return {"kv": (2, self.num_kv_heads, self.head_dim)}

    def forward(
        self, x: torch.Tensor, batch: ForwardBatch, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        num_tokens, num_heads = x.shape[0], self.num_heads
        q, k, v = linear_group(x, (self.q_proj, self.k_proj, self.v_proj))
        q = q.view(num_tokens, num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        qk = apply_rotary(torch.cat([q, k], dim=1), *rope, interleaved=self.interleaved_rope)
        q, k = qk[:, :num_heads], qk[:, num_heads:]
        kv_new = torch.stack([k, v], dim=1)  # [T, 2, KVH, D]
        # The paged KV keeps every position; a sliding window only masks the older ones.
        mask = (
            batch.attn_mask
            if self.sliding_window is None
            else batch.window_mask(self.sliding_window)
        )
        if batch.slot_mapping.dim() == 2:  # pages per KV head (EngineConfig.per_request_depth)
            # This step's KV joins the gathered context here and reaches the pages after the
            # last layer (LayerPaging.write_pending).
            kv = gather_head_pages(self.cache["kv"], batch.context_slots)
            kv = with_new_tokens(kv, kv_new, batch)
            batch.paging.pending.append((batch.slot_mapping, kv_new))
        else:
            write_cache(self.cache["kv"], kv_new, batch.slot_mapping)
            kernel, cache = paged_attention_kernel(), self.cache["kv"]
            # Decode or verifying rows, eager or compiled: the context read in place. (Inductor's
            # loops over the gathered context below cost more in a compiled step: SmolLM2 Q4_0
            # decode 262 -> 295 tok/s, same tokens.)
            if kernel.handles(batch, mask) and kernel.supports(q, cache):
                out = kernel.decode_batch(q, cache, batch, mask, self.scale)  # [T, H, D]
                return self._output(out, batch)
            kv = gather_cache(self.cache["kv"], batch.context_slots)  # [B, L, 2, KVH, D]
        if torch.compiler.is_compiling():  # compiled step without the kernel
            out = decode_attention(q[batch.query_index], kv, mask, self.scale)
            out = out.flatten(0, 1)[batch.token_index]  # [T, H, D]
        else:
            out = padded_attention(
                q, kv[:, :, 0], kv[:, :, 1], batch, self.scale, mask
            )  # [T, H, D]
        return self._output(out, batch)

    def _output(self, out: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        # out: [T, H, D] -> [T, hidden]
        num_tokens, num_heads = out.shape[:2]
        if batch.kv_head_keep is not None:  # heads a row's request skips add nothing
            group = num_heads // self.num_kv_heads
            keep = batch.kv_head_keep.repeat_interleave(group, dim=1)  # [T, H]
            out = out.masked_fill(~keep[:, :, None], 0.0)
        return self.o_proj(out.reshape(num_tokens, num_heads * self.head_dim))

    @classmethod
    def from_config(cls, c, interleaved_rope: bool = False, qk_norm: bool = False) -> "Attention":
        """GQA attention as HF's Llama-style configs describe it (explicit head_dim honoured)."""
        return cls(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            head_dim_of(c),
            interleaved_rope=interleaved_rope,
            qkv_bias=getattr(c, "attention_bias", False),
            qk_norm_eps=c.rms_norm_eps if qk_norm else None,
        )


def head_dim_of(c) -> int:
    return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

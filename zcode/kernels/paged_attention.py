"""Decode attention over the paged KV cache in C++ (attention.cpp), as a torch op.

`torch.ops.zcode.paged_decode_attention(q, kv_cache, context_slots, mask, scale)`: one query per
sequence, q [B, H, D] against its context read in place from kv_cache [blocks, block_size, 2,
KVH, D] through context_slots [B, L] (mask [B, 1, 1, L] bool or None) -> [B, H, D], fp32 sums;
the math of zcode.layers.attention.padded_attention without gathering the context or setting
up SDPA, which in eager decode cost ~25x the arithmetic (~75 us a layer on SmolLM2).

Built once with torch.utils.cpp_extension.load (plain loops the compiler vectorizes, any CPU);
where it does not build the layers keep gather + SDPA.
"""

import functools
from pathlib import Path

import torch

from zcode.forward_batch import ForwardBatch
from zcode.kernels.cpp_build import build_ops

SOURCE = Path(__file__).with_name("attention.cpp")
DTYPES = (torch.float32, torch.bfloat16)
MAX_GROUP = 64  # query heads per KV head the kernel holds


@functools.cache
def available() -> bool:
    """True when the kernel builds and loads here (built on first call)."""
    if not build_ops("zcode_attention", SOURCE, "using gather + SDPA"):
        return False

    @torch.library.register_fake("zcode::paged_decode_attention")
    def _(q, kv_cache, context_slots, mask, scale):
        return torch.empty_like(q)

    return True


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """q [T, H, D] and kv_cache [blocks, block_size, 2, KVH, D] are what the kernel reads."""
    return (
        q.device.type == "cpu"
        and q.dtype in DTYPES
        and kv_cache.dtype == q.dtype
        and kv_cache.dim() == 5
        and kv_cache.is_contiguous()
        and q.shape[1] // kv_cache.shape[3] <= MAX_GROUP
        and available()
    )


def decode(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    context_slots: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    # q: [B, H, D]; kv_cache: [blocks, block_size, 2, KVH, D]; context_slots: [B, L];
    # mask: [B or 1, 1, 1, L] bool or None -> [B, H, D]
    if mask is not None:
        mask = mask.expand(q.shape[0], -1, -1, -1)
    return torch.ops.zcode.paged_decode_attention(q, kv_cache, context_slots, mask, scale)


def decode_batch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: ForwardBatch,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """A decode batch's packed queries q [T, H, D] (one per sequence) -> [T, H, D]."""
    first = batch.query_index[:, 0]  # [B] each sequence's query
    return decode(q[first], kv_cache, batch.context_slots, mask, scale)[batch.token_index]

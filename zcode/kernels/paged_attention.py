"""Decode attention over the paged KV cache in C++ (attention.cpp), as a torch op.

`torch.ops.zcode.paged_decode_attention(q, kv_cache, context_slots, mask, scale)`: one query per
row (a decode step's sequence, or one token of a verifying step's), q [B, H, D] against its
context read in place from kv_cache [blocks, block_size, 2, KVH, D] through context_slots [B, L]
(mask [B, 1, 1, L] bool or None) -> [B, H, D] in q's dtype, fp32 sums (the cache in q's dtype,
or bf16 / fp16 under fp32 queries);
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
# (query dtype, cache dtype) pairs the kernel reads: the cache in the model's dtype, or narrower
# than fp32 queries (EngineConfig.kv_cache_dtype)
CACHE_DTYPES = {
    torch.float32: (torch.float32, torch.bfloat16, torch.float16),
    torch.bfloat16: (torch.bfloat16,),
}
MAX_GROUP = 64  # query heads per KV head the kernel holds
MAX_QUERY_WIDTH = 8  # queries a sequence decode_batch takes (a token and its drafts)


@torch.compiler.assume_constant_result  # a compiled step asks too: a constant of its graph
def available() -> bool:
    """True when the kernel builds and loads here (built on first call)."""
    return _built()


@functools.cache
def _built() -> bool:
    # -ffp-contract=off: the compiler may vectorize a loop or not depending on where its buffers
    # lie (a run-time overlap check); contracted to FMA in one version and not in the other,
    # the same query's output would move by an ulp from call to call.
    if not build_ops(
        "zcode_attention", SOURCE, "using gather + SDPA", extra_cflags=("-ffp-contract=off",)
    ):
        return False

    @torch.library.register_fake("zcode::paged_decode_attention")
    def _(q, kv_cache, context_slots, mask, scale):
        return torch.empty_like(q)

    return True


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """q [T, H, D] and kv_cache [blocks, block_size, 2, KVH, D] are what the kernel reads."""
    return (
        q.device.type == "cpu"
        and kv_cache.dtype in CACHE_DTYPES.get(q.dtype, ())
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


def handles(batch: ForwardBatch, mask: torch.Tensor | None) -> bool:
    """Whether decode_batch computes this step: one query a sequence (decode), or a few under a
    mask (verifying: a token and its drafts, each seeing the context up to itself). Longer
    queries (prefill) are SDPA's: each query here reads its whole context alone."""
    width = batch.query_index.shape[1]
    return width == 1 or (width <= MAX_QUERY_WIDTH and mask is not None)


def decode_batch(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: ForwardBatch,
    mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    """A decode or verifying batch's packed queries q [T, H, D] -> [T, H, D] (see `handles`):
    each query one row of the kernel, over its sequence's context slots under its own mask
    row, so a verifying step's drafts cost what as many decode rows do, not a gather + SDPA
    (SmolLM2 bf16, 16 sequences verifying: ~2x the attention of a decode step, before)."""
    width = batch.query_index.shape[1]
    if width == 1:
        first = batch.query_index[:, 0]  # [B] each sequence's query
        return decode(q[first], kv_cache, batch.context_slots, mask, scale)[batch.token_index]
    num_seqs, context_len = batch.context_slots.shape
    seq_of_token = batch.token_index // width  # [T]
    rows_mask = mask.expand(num_seqs, 1, width, context_len).reshape(-1, 1, 1, context_len)
    return decode(
        q, kv_cache, batch.context_slots[seq_of_token], rows_mask[batch.token_index], scale
    )

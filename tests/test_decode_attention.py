"""decode_attention (compiled decode and verifying steps without the C++ kernel, e.g. over KV
paged per head) against SDPA via padded_attention."""

import pytest
import torch

from zcode.forward_batch import ForwardBatch
from zcode.layers.attention import decode_attention, padded_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("query_lens,query_width", [(None, 1), ([4, 2, 1], 4)])
def test_matches_sdpa(dtype, num_heads, num_kv_heads, query_lens, query_width):
    """Decode steps (one query a sequence) and verifying steps (a token and its drafts, rows
    padded to the step's width)."""
    torch.manual_seed(num_heads)
    head_dim, block_size = 64, 16
    cache = torch.randn(8, block_size, 2, num_kv_heads, head_dim).to(dtype)
    # Three sequences (one spans two blocks) padded to a bucket of 4 rows.
    batch = ForwardBatch.build_decode(
        [5, 17, 1], [[1], [2, 3], [4]], block_size, 4, 0, query_lens, query_width
    )
    q = torch.randn(4 * query_width, num_heads, head_dim).to(dtype)  # [T, H, D]
    kv = cache.view(-1, 2, num_kv_heads, head_dim)[batch.context_slots]  # [B, L, 2, KVH, D]
    want = padded_attention(q, kv[:, :, 0], kv[:, :, 1], batch, head_dim**-0.5)
    got = decode_attention(q[batch.query_index], kv, batch.attn_mask, head_dim**-0.5)
    got = got.flatten(0, 1)[batch.token_index]  # [B, S, H, D] -> [T, H, D]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    # Masking is real: the one-token sequence's last query attends to its own slot only.
    last = batch.token_index.tolist().index(2 * query_width)
    assert torch.allclose(
        got[last].float(),
        kv[2, 0, 1].float().repeat_interleave(num_heads // num_kv_heads, dim=0),
        atol=tol,
    )


@pytest.mark.parametrize("head_dim", [64, 7])  # the AVX-512 path and the portable loops
def test_paged_kernel_passes_a_corrupted_position_on_as_nan(head_dim):
    """One NaN key deep in a long context (another chunk than the first, where the C++ kernel
    splits a sequence over tasks): that sequence's output is NaN, as SDPA's would be, so the
    engine's anomaly guard sees the corruption; the sequence beside it is untouched."""
    from zcode.kernels import paged_attention
    from zcode.kernels.paged import random_batch

    if not paged_attention.available():
        pytest.fail("the C++ attention kernel does not build here")
    generator = torch.Generator().manual_seed(0)
    batch, num_blocks = random_batch([1, 1], [600, 40], generator)
    cache = torch.randn(num_blocks, 16, 2, 2, head_dim, generator=generator)
    slot = int(batch.context_slots[0, 450])
    cache.view(-1, 2, 2, head_dim)[slot, 0, 1] = float("nan")  # a key of KV head 1
    q = torch.randn(2, 4, head_dim, generator=generator)
    out = paged_attention.decode_batch(q, cache, batch, batch.attn_mask, head_dim**-0.5)
    assert out[0, 2:].isnan().all()  # the query heads reading KV head 1
    assert not out[0, :2].isnan().any() and not out[1].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 7])  # the AVX-512 path and the portable loops
def test_paged_kernel_gives_a_query_the_same_bits_in_any_call(dtype, head_dim):
    """A query's output does not depend on the rows beside it or on how far the call's context
    reaches past its own mask: a verifying step's row (context padded with its drafts' slots and
    masked) is bit for bit the decode step's at that position, so drafts cannot move a greedy
    token off a near-tie. Lengths cross the kernel's chunks of positions."""
    from zcode.kernels import paged_attention

    if not paged_attention.available():
        pytest.fail("the C++ attention kernel does not build here")
    generator = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_kv_heads, num_heads = 40, 16, 3, 9
    cache = torch.randn(num_blocks, block_size, 2, num_kv_heads, head_dim, generator=generator)
    cache = cache.to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=generator)
    for position in (0, 31, 40, 147, 300, 500):
        alone_len = position + 1
        q = torch.randn(4, num_heads, head_dim, generator=generator).to(dtype)
        alone = paged_attention.decode(q[:1], cache, slots[None, :alone_len], None, 0.125)
        for extra in (1, 13, 40, 100):
            context_len = alone_len + extra
            mask = torch.ones(4, 1, 1, context_len, dtype=torch.bool)
            mask[0, ..., alone_len:] = False  # row 0: the same query, its drafts' slots masked
            context = slots[:context_len].expand(4, context_len).contiguous()
            beside = paged_attention.decode(q, cache, context, mask, 0.125)
            assert torch.equal(beside[0], alone[0]), (position, extra)

"""decode_attention (the compiled decode step's attention) against SDPA via padded_attention."""

import pytest
import torch

from zcode.forward_batch import ForwardBatch
from zcode.layers.attention import decode_attention, padded_attention


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4), (8, 1)])
def test_matches_sdpa(dtype, num_heads, num_kv_heads):
    torch.manual_seed(num_heads)
    head_dim, block_size = 64, 16
    cache = torch.randn(8, block_size, 2, num_kv_heads, head_dim).to(dtype)
    # Three sequences (one spans two blocks) padded to a bucket of 4 rows.
    batch = ForwardBatch.build_decode([5, 17, 1], [[1], [2, 3], [4]], block_size, 4, 0)
    q = torch.randn(4, num_heads, head_dim).to(dtype)
    kv = cache.view(-1, 2, num_kv_heads, head_dim)[batch.context_slots]  # [B, L, 2, KVH, D]
    want = padded_attention(q, kv[:, :, 0], kv[:, :, 1], batch, head_dim**-0.5)
    got = decode_attention(q, kv, batch.attn_mask, head_dim**-0.5)[batch.token_index]
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert got.dtype == dtype
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol)
    # Masking is real: the one-token sequence attends to its own slot only.
    assert torch.allclose(
        got[2].float(),
        kv[2, 0, 1].float().repeat_interleave(num_heads // num_kv_heads, dim=0),
        atol=tol,
    )

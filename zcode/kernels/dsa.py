"""DSA (DeepSeek sparse attention, GLM-5) ops: `dsa_indexer`, the lightning indexer's score and
top-k over the paged index-key cache, and `dsa_sparse_attention`, attention of each query over
only the context positions it selected.

References: the math of zcode.layers.mla.Indexer (ReLU of per-head dot products, weighted sum
over heads, causal mask, top-k) and padded_attention under the selection's keep mask. The
indexer returns the selected positions per packed token, sorted ascending, -1 where fewer than
top-k causal positions exist (the layer's keep mask is scatter of the valid ones).
CPU variant: `gathered` sparse attention reads only the selected keys and values of each token
(top-k x H x D instead of L x H x D).
"""

import torch
import torch.nn.functional as F

from zcode.forward_batch import ForwardBatch
from zcode.kernels.paged import BLOCK_SIZE, random_batch
from zcode.kernels.registry import define_op, register
from zcode.layers.attention import gather_cache, padded_attention

# uniform decode (no mask), ragged decode, prefill + chunked prefill, a context of several blocks
BATCH_SHAPES = (([1, 1], [7, 7]), ([1, 1, 1], [5, 13, 2]), ([3, 6], [3, 10]), ([2], [70]))


def _shape_name(query_lens, context_lens) -> str:
    return f"q{'-'.join(map(str, query_lens))}-ctx{'-'.join(map(str, context_lens))}"


def _shape_class(q: torch.Tensor, batch: ForwardBatch, topk: int) -> str:
    rows = "decode" if batch.query_index.shape[1] == 1 else "prefill"
    context = "short" if batch.context_slots.shape[1] <= 1024 else "long"
    return f"H{q.shape[1]}xD{q.shape[2]}|top{topk}|{rows}|{context}"


# --- indexer ---------------------------------------------------------------------------------


def indexer_scores(
    q: torch.Tensor, key_cache: torch.Tensor, head_weights: torch.Tensor, batch: ForwardBatch
) -> torch.Tensor:
    """q: [T, Hi, Di] (rotated); key_cache: [num_blocks, block_size, Di]; head_weights: [T, Hi]
    -> index scores [B, S, L] fp32, -inf where a query may not look."""
    keys = gather_cache(key_cache, batch.context_slots).float()  # [B, L, Di]
    queries = q[batch.query_index].float()  # [B, S, Hi, Di]
    scores = F.relu(torch.einsum("bshd,bld->bshl", queries, keys)) * q.shape[-1] ** -0.5
    weights = head_weights.float()[batch.query_index]  # [B, S, Hi]
    index_scores = (weights.unsqueeze(-2) @ scores).squeeze(-2)  # [B, S, L]
    if batch.attn_mask is not None:
        index_scores = index_scores.masked_fill(~batch.attn_mask[:, 0], float("-inf"))
    return index_scores


def select_topk(index_scores: torch.Tensor, batch: ForwardBatch, topk: int) -> torch.Tensor:
    """[B, S, L] scores -> [T, K] positions sorted ascending, -1 for masked picks."""
    values, ids = index_scores.topk(min(topk, index_scores.shape[-1]), dim=-1)
    ids = ids.masked_fill(values == float("-inf"), -1)
    ids = ids.flatten(0, 1)[batch.token_index]  # [T, K]
    return _sorted_ids(ids)


def _sorted_ids(ids: torch.Tensor) -> torch.Tensor:
    """Valid positions ascending, then the -1 padding."""
    big = torch.iinfo(ids.dtype).max
    ordered = torch.where(ids < 0, big, ids).sort(dim=-1).values
    return ordered.masked_fill(ordered == big, -1)


def indexer_reference(q, key_cache, head_weights, batch, topk: int) -> torch.Tensor:
    return select_topk(indexer_scores(q, key_cache, head_weights, batch), batch, topk)


def indexer_cases() -> list:
    heads, dim = 8, 16

    def case(query_lens, context_lens, topk):
        def make(generator: torch.Generator):
            batch, num_blocks = random_batch(query_lens, context_lens, generator)
            q = torch.randn(sum(query_lens), heads, dim, generator=generator)
            cache = torch.randn(num_blocks, BLOCK_SIZE, dim, generator=generator)
            weights = torch.randn(sum(query_lens), heads, generator=generator) * heads**-0.5
            return q, cache, weights, batch, topk

        return f"{_shape_name(query_lens, context_lens)}-top{topk}", make

    return [case(q, c, k) for q, c in BATCH_SHAPES for k in (4, 32)]


define_op(
    "dsa_indexer",
    indexer_reference,
    lambda q, cache, weights, batch, topk: _shape_class(q, batch, topk),
    indexer_cases,
)


# --- sparse attention ------------------------------------------------------------------------


def sparse_attention_reference(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: ForwardBatch,
    ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q: [T, H, Dk]; keys: [B, L, H, Dk]; values: [B, L, H, Dv]; ids: [T, K] selected context
    positions (-1 = none) -> [T, H, Dv]."""
    num_seqs, context_len = keys.shape[:2]
    max_query = batch.query_index.shape[1]
    keep = torch.zeros(num_seqs * max_query, context_len + 1, dtype=torch.bool, device=q.device)
    keep[batch.token_index[:, None], torch.where(ids < 0, context_len, ids)] = True
    keep = keep[:, :context_len].view(num_seqs, 1, max_query, context_len)
    mask = keep if batch.attn_mask is None else keep & batch.attn_mask
    return padded_attention(q, keys, values, batch, scale, mask)


def sparse_attention_cases() -> list:
    heads, nope_dim, v_dim = 4, 24, 16

    def case(query_lens, context_lens, topk):
        def make(generator: torch.Generator):
            batch, num_blocks = random_batch(query_lens, context_lens, generator)
            num_tokens, context_len = sum(query_lens), max(context_lens)
            q = torch.randn(num_tokens, heads, nope_dim, generator=generator)
            keys = torch.randn(len(query_lens), context_len, heads, nope_dim, generator=generator)
            values = torch.randn(len(query_lens), context_len, heads, v_dim, generator=generator)
            scores = torch.rand(
                len(query_lens), batch.query_index.shape[1], context_len, generator=generator
            )
            if batch.attn_mask is not None:
                scores = scores.masked_fill(~batch.attn_mask[:, 0], float("-inf"))
            ids = select_topk(scores, batch, topk)
            return q, keys, values, batch, ids, nope_dim**-0.5

        return f"{_shape_name(query_lens, context_lens)}-top{topk}", make

    return [case(q, c, k) for q, c in BATCH_SHAPES for k in (3, 32)]


define_op(
    "dsa_sparse_attention",
    sparse_attention_reference,
    lambda q, keys, values, batch, ids, scale: _shape_class(q, batch, ids.shape[1]),
    sparse_attention_cases,
)


def token_seq_ids(batch: ForwardBatch) -> torch.Tensor:
    """[T] the sequence each packed token belongs to."""
    return batch.token_index // batch.query_index.shape[1]


@register("dsa_sparse_attention", "gathered")
def sparse_attention_gathered(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    batch: ForwardBatch,
    ids: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    seq = token_seq_ids(batch)[:, None]  # [T, 1]
    valid = (ids >= 0) & (ids <= batch.positions[:, None])  # selected and causal: [T, K]
    safe = ids.clamp(min=0)
    k_sel = keys[seq, safe].float()  # [T, K, H, Dk]
    v_sel = values[seq, safe].float()  # [T, K, H, Dv]
    scores = torch.einsum("thd,tkhd->thk", q.float(), k_sel) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("thk,tkhd->thd", probs, v_sel).to(q.dtype)

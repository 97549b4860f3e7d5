"""Ops `attention` (GQA over the paged KV cache, prefill and decode) and `mla` (multi-head latent
attention over the paged latent cache).

References: the layers' own path, zcode.layers.attention.gather_cache + padded_attention (SDPA
over the gathered, padded context), and for MLA the expansion of the latent through kv_b_proj
as zcode.layers.mla.MLAttention does it. CPU variants:
- attention `decode-grouped`: one query per sequence, the query heads of a KV head multiplied as
  one group against that head's keys, no padding or KV-head repetition;
- attention `cpp-paged`: the C++ kernel of zcode.kernels.paged_attention (what eager decode and
  verifying steps run), the context read in place from the pages;
- mla `absorbed`: kv_b_proj folded into the query and the output (the DeepSeek decode trick):
  attention runs in the latent space, so the context is never expanded to H heads.
"""

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.kernels import paged_attention
from zcode.kernels.paged import BLOCK_SIZE, random_batch
from zcode.kernels.registry import define_op, register
from zcode.layers.attention import gather_cache, padded_attention

# (query lens, context lens): uniform decode (no mask), ragged decode, verifying (a token and
# its drafts a sequence), prefill + chunked prefill
BATCH_SHAPES = (
    ([1, 1], [7, 7]),
    ([1, 1, 1], [5, 13, 2]),
    ([4, 1, 2], [9, 5, 21]),
    ([3, 12], [3, 30]),
)


def _shape_name(query_lens: list[int], context_lens: list[int]) -> str:
    return f"q{'-'.join(map(str, query_lens))}-ctx{'-'.join(map(str, context_lens))}"


def _rows(batch: ForwardBatch) -> str:
    width = batch.query_index.shape[1]
    if width == 1:
        return "decode"
    return "verify" if paged_attention.handles(batch, batch.attn_mask) else "prefill"


# --- attention -------------------------------------------------------------------------------


def attention_reference(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    # q: [T, H, D]; kv_cache: [num_blocks, block_size, 2, KVH, D] -> [T, H, D]
    kv = gather_cache(kv_cache, batch.context_slots)  # [B, L, 2, KVH, D]
    return padded_attention(q, kv[:, :, 0], kv[:, :, 1], batch, scale)


def attention_shape_class(q: torch.Tensor, kv_cache: torch.Tensor, batch, scale) -> str:
    context = "short" if batch.context_slots.shape[1] <= 256 else "long"
    dtypes = f"{q.dtype}" + (f"/{kv_cache.dtype}" if kv_cache.dtype != q.dtype else "")
    return f"H{q.shape[1]}xKV{kv_cache.shape[3]}xD{q.shape[2]}|{_rows(batch)}|{context}|{dtypes}"


def _tolerance(q: torch.Tensor, *args) -> tuple[float, float]:
    return (1e-4, 1e-5) if q.dtype == torch.float32 else (2e-2, 2e-2)


def attention_cases() -> list:
    def case(query_lens, context_lens, heads, kv_heads, dim, dtype, window=None, kv_dtype=None):
        kv_dtype = kv_dtype or dtype

        def make(generator: torch.Generator):
            batch, num_blocks = random_batch(query_lens, context_lens, generator)
            if window is not None:  # a sliding window (Gemma 3's): early positions masked
                batch = dataclasses.replace(batch, attn_mask=batch.window_mask(window))
            q = torch.randn(sum(query_lens), heads, dim, generator=generator).to(dtype)
            cache = torch.randn(num_blocks, BLOCK_SIZE, 2, kv_heads, dim, generator=generator)
            return q, cache.to(kv_dtype), batch, dim**-0.5

        name = f"{_shape_name(query_lens, context_lens)}-H{heads}-KV{kv_heads}-D{dim}-{dtype}"
        name += f"-kv-{kv_dtype}" if kv_dtype != dtype else ""
        return name + (f"-window{window}" if window else ""), make

    cases = [case(q, c, 6, 2, 16, torch.float32) for q, c in BATCH_SHAPES]
    return cases + [
        case([1, 1], [9, 9], 9, 3, 64, torch.bfloat16),
        case([1], [5], 3, 3, 7, torch.float32),
        # contexts of several chunks (the C++ kernel splits a sequence's positions over tasks
        # and merges them): decode and verifying rows, head dims 128 and 256
        case([1, 1], [600, 150], 8, 2, 128, torch.float32),
        case([4, 1], [300, 41], 6, 2, 64, torch.float32),
        case([1], [300], 4, 1, 256, torch.bfloat16),
        # more query heads per KV head than the C++ kernel takes at once (4): GLM-4.5-Air's
        # 12, and 7 (4 + 3)
        case([2, 1], [150, 47], 24, 2, 128, torch.float32),
        case([1, 1], [300, 130], 14, 2, 32, torch.float32, kv_dtype=torch.float16),
        # a window that masks whole chunks of a row's context
        case([3, 1], [600, 20], 4, 2, 64, torch.float32, window=100),
        # a KV cache narrower than the fp32 queries (EngineConfig.kv_cache_dtype)
        case([1, 1], [600, 150], 8, 2, 128, torch.float32, kv_dtype=torch.bfloat16),
        case([4, 1], [300, 41], 6, 2, 64, torch.float32, kv_dtype=torch.float16),
        case([1], [5], 3, 3, 7, torch.float32, kv_dtype=torch.float16),
    ]


define_op("attention", attention_reference, attention_shape_class, attention_cases, _tolerance)


@register("attention", "decode-grouped", supports=lambda q, c, batch, s: _rows(batch) == "decode")
def decode_grouped(
    q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float
) -> torch.Tensor:
    kv = gather_cache(kv_cache, batch.context_slots)  # [B, L, 2, KVH, D]
    keys, values = kv[:, :, 0], kv[:, :, 1]
    num_seqs, _, num_kv_heads, head_dim = keys.shape
    qg = q[batch.query_index[:, 0]].view(num_seqs, num_kv_heads, -1, head_dim)  # [B, KVH, G, D]
    scores = torch.einsum("bkgd,blkd->bkgl", qg.float(), keys.float()) * scale
    if batch.attn_mask is not None:  # [B, 1, 1, L]
        scores = scores.masked_fill(~batch.attn_mask[:, :, :1], float("-inf"))
    probs = scores.softmax(dim=-1)
    out = torch.einsum("bkgl,blkd->bkgd", probs, values.float()).to(q.dtype)
    return out.reshape(num_seqs, -1, head_dim)[batch.token_index]


@register(
    "attention",
    "cpp-paged",
    supports=lambda q, c, batch, s: _rows(batch) != "prefill" and paged_attention.supports(q, c),
)
def cpp_paged(q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float):
    """The layers' eager decode and verifying path: the C++ kernel reads the context from the
    pages, one query a row."""
    return paged_attention.decode_batch(q, kv_cache, batch, batch.attn_mask, scale)


# --- MLA -------------------------------------------------------------------------------------


def mla_reference(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_proj: nn.Module,
    batch: ForwardBatch,
    v_dim: int,
    scale: float,
    keep: torch.Tensor | None,
) -> torch.Tensor:
    """q: [T, H, nope + rope]; latent_cache: [num_blocks, block_size, R + rope]; kv_b_proj: the
    layer's R -> H * (nope + v) linear (any weight format); keep: [B, 1, S, L] bool (DSA) or None
    -> [T, H, v]. The context's keys and values are expanded from the latent for every call."""
    num_heads = q.shape[1]
    kv_lora_rank = kv_b_proj.in_features
    nope_dim = kv_b_proj.out_features // num_heads - v_dim
    latent = gather_cache(latent_cache, batch.context_slots).to(q.dtype)  # [B, L, R + rope]
    num_seqs, context_len = latent.shape[:2]
    k_pass, k_rot = latent.split([kv_lora_rank, latent.shape[-1] - kv_lora_rank], dim=-1)
    kv = kv_b_proj(k_pass).view(num_seqs, context_len, num_heads, -1)
    k_nope, values = kv.split([nope_dim, v_dim], dim=-1)
    k_rot = k_rot[:, :, None, :].expand(-1, -1, num_heads, -1)
    keys = torch.cat([k_nope, k_rot], dim=-1)  # [B, L, H, nope + rope]
    return padded_attention(q, keys, values, batch, scale, _mla_mask(batch, keep))


def _mla_mask(batch: ForwardBatch, keep: torch.Tensor | None) -> torch.Tensor | None:
    """The batch's causal mask, narrowed to the DSA indexer's selection where there is one."""
    if keep is None or batch.attn_mask is None:
        return batch.attn_mask if keep is None else keep
    return keep & batch.attn_mask


def mla_shape_class(q, latent_cache, kv_b_proj, batch, v_dim, scale, keep) -> str:
    context = "short" if batch.context_slots.shape[1] <= 256 else "long"
    return f"H{q.shape[1]}xR{kv_b_proj.in_features}|{_rows(batch)}|{context}|{q.dtype}"


def mla_cases() -> list:
    heads, nope, rope, v_dim, rank = 4, 16, 8, 16, 32

    def case(query_lens, context_lens, with_keep: bool, dtype=torch.float32, kv_dtype=None):
        kv_dtype = kv_dtype or dtype

        def make(generator: torch.Generator):
            batch, num_blocks = random_batch(query_lens, context_lens, generator)
            q = torch.randn(sum(query_lens), heads, nope + rope, generator=generator)
            cache = torch.randn(num_blocks, BLOCK_SIZE, rank + rope, generator=generator)
            kv_b_proj = nn.Linear(rank, heads * (nope + v_dim), bias=False, dtype=dtype)
            with torch.no_grad():
                kv_b_proj.weight.copy_(
                    torch.randn(heads * (nope + v_dim), rank, generator=generator) * rank**-0.5
                )
            keep = None
            if with_keep:
                shape = (len(query_lens), 1, batch.query_index.shape[1], max(context_lens))
                keep = torch.rand(shape, generator=generator) < 0.6
                keep[..., 0] = True  # every query keeps its first token: no empty row
            scale = (nope + rope) ** -0.5
            return q.to(dtype), cache.to(kv_dtype), kv_b_proj, batch, v_dim, scale, keep

        name = f"{_shape_name(query_lens, context_lens)}{'-dsa' if with_keep else ''}-{dtype}"
        return name + (f"-kv-{kv_dtype}" if kv_dtype != dtype else ""), make

    cases = [case(q, c, keep) for q, c in BATCH_SHAPES for keep in (False, True)]
    return cases + [
        case([1, 1], [9, 9], True, torch.bfloat16),
        # a latent cache narrower than the fp32 queries (EngineConfig.kv_cache_dtype)
        case([4, 1, 2], [9, 5, 21], True, kv_dtype=torch.float16),
        case([1, 1], [7, 7], False, kv_dtype=torch.bfloat16),
    ]


define_op("mla", mla_reference, mla_shape_class, mla_cases, _tolerance)


@register("mla", "absorbed", supports=lambda q, cache, kv_b_proj, *rest: _float_weight(kv_b_proj))
def mla_absorbed(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_b_proj: nn.Module,
    batch: ForwardBatch,
    v_dim: int,
    scale: float,
    keep: torch.Tensor | None,
) -> torch.Tensor:
    num_heads, kv_lora_rank = q.shape[1], kv_b_proj.in_features
    w = kv_b_proj.weight.view(num_heads, -1, kv_lora_rank)  # [H, nope + v, R]
    nope_dim = w.shape[1] - v_dim
    w_uk, w_uv = w[:, :nope_dim], w[:, nope_dim:]
    q_nope, q_rot = q.split([nope_dim, q.shape[-1] - nope_dim], dim=-1)
    # q_nope . (W_uk c) = (W_uk^T q_nope) . c: queries move into the latent space. The weight
    # stays in its dtype (an fp32 copy of a bf16 GLM-5 layer's would be ~60 MB a call).
    q_latent = torch.einsum("thn,hnr->thr", q_nope.to(w.dtype), w_uk).float()
    q_latent = torch.cat([q_latent, q_rot.float()], dim=-1)  # [T, H, R + rope]
    latent = gather_cache(latent_cache, batch.context_slots).float()  # [B, L, R + rope]
    qp = q_latent[batch.query_index]  # [B, S, H, R + rope]
    scores = torch.einsum("bshc,blc->bhsl", qp, latent) * scale
    if (mask := _mla_mask(batch, keep)) is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1)
    out_latent = torch.einsum("bhsl,blr->bshr", probs, latent[..., :kv_lora_rank])
    out = torch.einsum("bshr,hvr->bshv", out_latent.to(w.dtype), w_uv)  # [B, S, H, v]
    return out.reshape(-1, num_heads, v_dim)[batch.token_index].to(q.dtype)


def mla_in_graph(kv_b_proj: nn.Module) -> Callable:
    """What a compiled decode graph runs (one query per sequence): the absorbed form wherever it
    applies, since it reads the context once per head instead of expanding it."""
    return mla_absorbed if _float_weight(kv_b_proj) else mla_reference


def _float_weight(linear: nn.Module) -> bool:
    return isinstance(linear, nn.Linear) and linear.weight.dtype in (torch.float32, torch.bfloat16)

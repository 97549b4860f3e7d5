"""Multi-head latent attention with the DSA lightning indexer (GLM-5 / DeepSeek-V3.2 style).

The cache holds, per token, the normalised KV latent with its rotated shared key
([kv_lora_rank + qk_rope_head_dim]) and the indexer's own key ([index_head_dim]). Attention over
it is the kernel registry's `mla` op (zcode.kernels.attention): its reference expands every
cached latent to per-head keys and values through kv_b_proj, ~H * (nope + v) * R multiply-adds
per context token and layer; its `absorbed` variant folds kv_b_proj into the query and the
output instead, ~H * (2R + rope) per context token and query (GLM-5: ~80x less at decode).
Eager calls take the autotuned choice per shape class; compiled graphs take `mla_in_graph`.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from zcode.forward_batch import ForwardBatch
from zcode.layers.attention import gather_cache, write_cache
from zcode.layers.linear import Linear
from zcode.layers.norm import RMSNorm
from zcode.layers.rotary import apply_rotary


class Indexer(nn.Module):
    """Scores every cached token for every query and keeps the `index_topk` best."""

    def __init__(self, hf_config) -> None:
        super().__init__()
        c = hf_config
        self.num_heads, self.head_dim = c.index_n_heads, c.index_head_dim
        self.index_topk = c.index_topk
        self.wq_b = Linear(c.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.wk = Linear(c.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = Linear(c.hidden_size, self.num_heads, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        batch: ForwardBatch,
        key_cache: torch.Tensor,
    ) -> torch.Tensor:
        """x: [T, D], q_resid: [T, q_lora_rank] -> keep mask [B, 1, S_max, L_max] bool."""
        num_tokens = x.shape[0]
        q = self.wq_b(q_resid).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(num_tokens, 1, self.head_dim)
        q = apply_rotary(q, *rope, interleaved=True)  # RoPE on the first qk_rope_head_dim dims
        k = apply_rotary(k, *rope, interleaved=True)
        write_cache(key_cache, k[:, 0], batch.slot_mapping)
        keys = gather_cache(key_cache, batch.context_slots).float()  # [B, L, Di]
        queries = q[batch.query_index].float()  # [B, S, Hi, Di]
        scores = F.relu(torch.einsum("bshd,bld->bshl", queries, keys)) * self.head_dim**-0.5
        head_weights = (
            self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.num_heads**-0.5
        )  # [T, Hi]
        head_weights = head_weights[batch.query_index]  # [B, S, Hi]
        index_scores = (head_weights.unsqueeze(-2) @ scores).squeeze(-2)  # [B, S, L]
        causal = batch.attn_mask
        if causal is not None:
            index_scores = index_scores.masked_fill(~causal[:, 0], float("-inf"))
        topk = index_scores.topk(min(self.index_topk, index_scores.shape[-1]), dim=-1).indices
        keep = torch.zeros_like(index_scores, dtype=torch.bool).scatter_(-1, topk, True)
        return keep[:, None]


class MLAttention(nn.Module):
    def __init__(self, hf_config, use_indexer: bool) -> None:
        super().__init__()
        c = hf_config
        self.num_heads = c.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        self.kv_lora_rank = c.kv_lora_rank
        qk_head_dim = self.nope_dim + self.rope_dim
        self.scale = qk_head_dim**-0.5 * _yarn_mscale_sq(c)
        self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = Linear(c.q_lora_rank, self.num_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(
            c.hidden_size, c.kv_lora_rank + self.rope_dim, bias=c.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = Linear(
            c.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = Linear(self.num_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.indexer = Indexer(c) if use_indexer else None
        self.cache: dict[str, torch.Tensor] = {}
        self._kernels: dict[tuple, Callable] = {}  # (shape class, kv_b_proj) -> implementation

    def cache_spec(self) -> dict[str, tuple[int, ...]]:
        spec = {"latent": (self.kv_lora_rank + self.rope_dim,)}
        if self.indexer is not None:
            spec["index_k"] = (self.indexer.head_dim,)
        return spec

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rope: tuple[torch.Tensor, torch.Tensor],
        prev_keep: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, D] -> (out [T, D], DSA keep mask [B, 1, S, L] for layers that share it)."""
        num_tokens = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(num_tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary(q_rot, *rope, interleaved=True)], dim=-1)

        kv_pass, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], -1)
        k_rot = apply_rotary(k_rot[:, None, :], *rope, interleaved=True)[:, 0]
        write_cache(
            self.cache["latent"],
            torch.cat([self.kv_a_layernorm(kv_pass), k_rot], -1),
            batch.slot_mapping,
        )
        if self.indexer is not None:
            keep = self.indexer(x, q_resid, rope, batch, self.cache["index_k"])
        elif prev_keep is not None:
            keep = prev_keep
        else:
            raise ValueError(
                "a shared DSA layer needs the top-k selection of an earlier full layer"
            )
        args = (q, self.cache["latent"], self.kv_b_proj, batch, self.v_dim, self.scale, keep)
        out = self._attention(*args)(*args)  # [T, H, v_dim]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.v_dim)), keep

    def _attention(self, *args) -> Callable:
        """The registry's `mla` implementation for these arguments."""
        from zcode import kernels  # zcode.kernels imports zcode.layers

        if torch.compiler.is_compiling():  # no timing, nor guards on the context length
            return kernels.attention.mla_in_graph(self.kv_b_proj)
        # kv_b_proj in the key: a precision plan may swap in a quantized one, which only the
        # reference takes
        key = (kernels.OPS["mla"].shape_class(*args), self.kv_b_proj)
        if (fn := self._kernels.get(key)) is None:
            fn = self._kernels[key] = kernels.get("mla", *args)
        return fn


def _yarn_mscale_sq(hf_config) -> float:
    params = getattr(hf_config, "rope_parameters", None) or {}
    mscale_all_dim = params.get("mscale_all_dim", 0)
    if params.get("rope_type", "default") == "default" or not mscale_all_dim:
        return 1.0
    factor = params["factor"]
    mscale = (
        1.0 if factor <= 1 else 0.1 * mscale_all_dim * torch.log(torch.tensor(factor)).item() + 1
    )
    return mscale * mscale

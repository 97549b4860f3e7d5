"""The modules a sharded model runs: each wraps the rank's slice of a loaded module and adds the
collective that makes its output whole again (Megatron-LM's tensor parallelism).

- `RowParallel`: a linear over the rank's slice of the input features (o_proj, down_proj); the
  partial products are summed by an all-reduce, then the bias is added once.
- `VocabParallelEmbedding`: the rank's rows of the vocabulary; ids outside them look up zeros,
  and the all-reduce fills in the other ranks' rows.
- `VocabParallelHead`: the lm_head's rows of the rank's vocabulary; the all-gather puts the
  logits of every rank side by side, so every rank returns the whole [N, vocab].
- `ParallelMoE`: a MoE layer's routed experts sliced or a range of them whole, the shared
  expert sliced; the all-reduce sums the ranks' parts.

Column-parallel linears (q/k/v, gate/up) need no wrapper: their slice of the output features is
what the next, row-parallel linear reads.
"""

import torch
from torch import nn

from zcode.distributed.group import TPGroup, all_gather, all_reduce


class RowParallel(nn.Module):
    def __init__(self, linear: nn.Module, bias: torch.Tensor | None, group: TPGroup) -> None:
        """linear: the rank's columns of the weight, without bias."""
        super().__init__()
        self.linear = linear
        self.register_buffer("bias", bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., K / world_size] -> [..., N], summed over the ranks
        out = all_reduce(self.linear(x), self.group)
        return out if self.bias is None else out + self.bias.to(out.dtype)


class VocabParallelEmbedding(nn.Module):
    def __init__(self, embed: nn.Module, start: int, group: TPGroup) -> None:
        """embed: rows [start, start + embed.num_embeddings) of the vocabulary."""
        super().__init__()
        self.embed, self.start, self.group = embed, start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids: [T] -> [T, D]
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.embed.num_embeddings)
        out = self.embed(torch.where(inside, local, 0))
        return all_reduce(out.masked_fill(~inside[..., None], 0.0), self.group)


class VocabParallelHead(nn.Module):
    def __init__(self, linear: nn.Module, vocab_sizes: list[int], group: TPGroup) -> None:
        """linear: this rank's rows of the lm_head; vocab_sizes: every rank's row count."""
        super().__init__()
        self.linear, self.vocab_sizes, self.group = linear, vocab_sizes, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, D] -> logits [N, vocab]
        logits = self.linear(hidden)  # [N, vocab_sizes[rank]]
        width = max(self.vocab_sizes)  # all_gather takes one shape: pad, then trim
        padded = torch.nn.functional.pad(logits, (0, width - logits.shape[-1]))
        parts = all_gather(padded, self.group)
        return torch.cat([p[..., :n] for p, n in zip(parts, self.vocab_sizes)], dim=-1)


class ParallelMoE(nn.Module):
    """A MoE layer of which this rank holds a part; one all-reduce sums the parts.

    The router is replicated: the hidden states are the same on every rank (attention's
    all-reduce made them whole), so every rank routes every token to the same experts. The
    shared expert is tensor-parallel (a slice of its intermediate features, as a dense FFN).
    The routed experts are held one of two ways (zcode.distributed.shard.shard_moe):
    - tensor parallel (the default): every expert's slice of its intermediate features
      (gate/up rows, down_proj columns); `first_expert` 0, all experts held;
    - expert parallel: whole experts [first_expert, first_expert + len(moe.experts)); a token's
      assignments to other ranks' experts are skipped here (expert id -1).
    Each rank runs its part for every token (the fused op over its slices or its experts), and
    the all-reduce adds the routed and shared parts of all ranks at once.

    Bytes sent per token and layer (zcode.distributed.traffic, bf16, GLM-4.5-Air's D 4096,
    128 experts, top-8): this all-reduce 16 KB at N = 2, 115 KB at N = 8; an all-to-all dispatch
    and combine (attention data-parallel) 16 KB, 77 KB: at 2 ranks a token almost always has an
    expert on the other one (p 0.997), so the all-to-all saves nothing, and it needs tokens
    partitioned over the ranks, not replicated as under tensor-parallel attention.
    """

    def __init__(self, moe: nn.Module, first_expert: int, group: TPGroup) -> None:
        super().__init__()
        self.moe, self.first_expert, self.group = moe, first_expert, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, D], the same on every rank -> [T, D] summed over the ranks
        weights, expert_ids = self.moe.route(x)  # [T, top_k], ids among all experts (-1: dropped)
        local_ids = expert_ids - self.first_expert
        held = (local_ids >= 0) & (local_ids < len(self.moe.experts))
        local_ids = local_ids.masked_fill(~held, -1)
        return all_reduce(self.moe.run_experts(x, weights, local_ids), self.group)

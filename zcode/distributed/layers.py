"""The modules a sharded model runs: each wraps the rank's slice of a loaded module and adds the
collective that makes its output whole again (Megatron-LM's tensor parallelism).

- `RowParallel`: a linear over the rank's slice of the input features (o_proj, down_proj); the
  partial products are summed by an all-reduce, then the bias is added once.
- `VocabParallelEmbedding`: the rank's rows of the vocabulary; ids outside them look up zeros,
  and the all-reduce fills in the other ranks' rows.
- `VocabParallelHead`: the lm_head's rows of the rank's vocabulary; the all-gather puts the
  logits of every rank side by side, so every rank returns the whole [N, vocab].

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

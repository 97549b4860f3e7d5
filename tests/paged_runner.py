"""Drives a model directly over a paged KV cache, one ForwardBatch per step, without the engine.

A test chooses exactly which sequences share a step and how their tokens are chunked, and gets
the logits of every new token back. Blocks are handed out in shuffled order so that block tables
are not contiguous. Creating a runner gives the model a fresh cache: an older runner on the same
model must not be stepped again.
"""

import torch
from torch import nn

from zcode.engine.kv_cache import KVCache
from zcode.forward_batch import ForwardBatch


class PagedRunner:
    def __init__(
        self,
        net: nn.Module,
        num_blocks: int = 64,
        block_size: int = 4,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.net, self.block_size = net, block_size
        KVCache(net.attention_layers(), num_blocks, block_size, kv_dtype)
        order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
        self.free_blocks = order.tolist()
        self.block_tables: dict[str, list[int]] = {}
        self.context_lens: dict[str, int] = {}

    @torch.inference_mode()
    def step(self, chunks: dict[str, list[int]]) -> dict[str, torch.Tensor]:
        """One forward pass in which each named sequence appends its chunk of tokens.

        Returns per sequence the logits of every token of its chunk, [len(chunk), V] fp32.
        """
        query_lens, context_lens, tables, input_ids = [], [], [], []
        for name, chunk in chunks.items():
            context_len = self.context_lens.get(name, 0) + len(chunk)
            table = self.block_tables.setdefault(name, [])
            while len(table) * self.block_size < context_len:
                table.append(self.free_blocks.pop())
            self.context_lens[name] = context_len
            query_lens.append(len(chunk))
            context_lens.append(context_len)
            tables.append(table)
            input_ids.extend(chunk)
        batch = ForwardBatch.build(
            query_lens, context_lens, tables, self.block_size, num_logits=query_lens
        )
        logits = self.net(torch.tensor(input_ids, dtype=torch.int64), batch)  # [T, V]
        return dict(zip(chunks, logits.split(query_lens), strict=True))

    def prefill_then_decode(
        self, name: str, token_ids: list[int], prefill_len: int
    ) -> torch.Tensor:
        """Logits of every token: one prefill of `prefill_len`, then one token per step."""
        logits = [self.step({name: token_ids[:prefill_len]})[name]]
        for token in token_ids[prefill_len:]:
            logits.append(self.step({name: [token]})[name])
        return torch.cat(logits)  # [len(token_ids), V]

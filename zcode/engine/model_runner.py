"""Owns the model and its KV cache; turns a scheduled step into one forward pass."""

import torch
from torch import nn

from zcode.engine.kv_cache import KVCache
from zcode.engine.scheduler import ScheduledSeq
from zcode.forward_batch import ForwardBatch


class ModelRunner:
    def __init__(self, model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype):
        self.model = model
        self.block_size = block_size
        self.kv_cache = KVCache(model.attention_layers(), num_blocks, block_size, dtype)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> list[torch.Tensor]:
        """Runs one step; returns per scheduled sequence the logits it asked for, [n_i, V] fp32.

        A sequence asks for its last token's logits when this step completes its known tokens,
        and for every new token's logits while its prompt log-probabilities are wanted.
        """
        input_ids, query_lens, context_lens, tables, num_logits = [], [], [], [], []
        for s in scheduled:
            start = s.seq.num_computed_tokens
            input_ids.extend(s.seq.token_ids[start : start + s.num_new_tokens])
            query_lens.append(s.num_new_tokens)
            context_lens.append(start + s.num_new_tokens)
            tables.append(s.seq.block_table)
            if s.seq.wants_prompt_logprobs:
                num_logits.append(s.num_new_tokens)
            else:
                num_logits.append(1 if s.completes_prompt else 0)
        batch = ForwardBatch.build(query_lens, context_lens, tables, self.block_size, num_logits)
        logits = self.model(torch.tensor(input_ids, dtype=torch.int64), batch)  # [N, V]
        return list(logits.split(num_logits))

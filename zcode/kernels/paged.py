"""Random paged KV caches and batches for the attention ops' test cases and autotuning."""

import torch

from zcode.forward_batch import ForwardBatch

BLOCK_SIZE = 4


def random_batch(
    query_lens: list[int], context_lens: list[int], generator: torch.Generator
) -> tuple[ForwardBatch, int]:
    """A ForwardBatch over randomly placed blocks; returns it and the number of blocks."""
    blocks_per_seq = [-(-n // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks hold garbage no sequence may read
    order = torch.randperm(num_blocks, generator=generator).tolist()
    tables, start = [], 0
    for n in blocks_per_seq:
        tables.append(order[start : start + n])
        start += n
    return ForwardBatch.build(query_lens, context_lens, tables, BLOCK_SIZE), num_blocks

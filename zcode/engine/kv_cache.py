"""Paged KV cache storage: a [num_blocks, block_size, *shape] tensor per layer and quantity.

Each attention module declares what it caches per token (`cache_spec()`: K and V for GQA, the
latent and the indexer key for MLA/DSA); all layers share one block table per sequence.
"""

import math

import torch
from torch import nn


def kv_bytes_per_token(attention_layers: list[nn.Module], dtype: torch.dtype) -> int:
    itemsize = torch.empty((), dtype=dtype).element_size()
    return sum(
        math.prod(shape) * itemsize
        for layer in attention_layers
        for shape in layer.cache_spec().values()
    )


class KVCache:
    def __init__(
        self,
        attention_layers: list[nn.Module],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.bytes_per_token = kv_bytes_per_token(attention_layers, dtype)
        for layer in attention_layers:
            layer.cache = {
                name: torch.zeros(num_blocks, block_size, *shape, dtype=dtype)
                for name, shape in layer.cache_spec().items()
            }

    @staticmethod
    def num_blocks_for(
        memory_bytes: int, attention_layers: list[nn.Module], block_size: int, dtype: torch.dtype
    ) -> int:
        return max(1, memory_bytes // (kv_bytes_per_token(attention_layers, dtype) * block_size))

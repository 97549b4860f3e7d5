"""Paged KV cache storage: a [num_blocks, block_size, *shape] tensor per layer and quantity.

Each attention module declares what it caches per token (`cache_spec()`: K and V for GQA, the
latent and the indexer key for MLA/DSA); all layers share one block table per sequence. With
`shared_pages` the layers instead share one tensor of pages, each layer finding its own through
a PagePool (per-request layer skipping, zcode.engine.page_pool).
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
        shared_pages: bool = False,
    ) -> None:
        """num_blocks: blocks per layer; with shared_pages, pages shared by all layers."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.bytes_per_token = kv_bytes_per_token(attention_layers, dtype)
        if shared_pages:
            spec = uniform_cache_spec(attention_layers)
            pages = {
                name: torch.zeros(num_blocks, block_size, *shape, dtype=dtype)
                for name, shape in spec.items()
            }
            for layer in attention_layers:
                layer.cache = dict(pages)
            return
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


def uniform_cache_spec(attention_layers: list[nn.Module]) -> dict[str, tuple[int, ...]]:
    """The one per-token cache spec every layer has, or NotImplementedError."""
    specs = {tuple(sorted(layer.cache_spec().items())) for layer in attention_layers}
    if len(specs) != 1 or not next(iter(specs)):
        raise NotImplementedError(
            "per-layer KV pages for layers that cache different shapes (or nothing: a plan's "
            "skipped layers or pruned heads); pages of one size serve uniform layers only"
        )
    return dict(next(iter(specs)))

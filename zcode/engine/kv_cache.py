"""Paged KV cache storage: a [num_blocks, block_size, *shape] tensor per layer and quantity.

Each attention module declares what it caches per token (`cache_spec()`: K and V for GQA, the
latent and the indexer key for MLA/DSA); all layers share one block table per sequence. With
`shared_pages` the layers instead share one tensor of pages of one KV head each, each layer
finding its own through a PagePool (per-request layer and head skipping, zcode.engine.page_pool).
"""

import math

import torch
from torch import nn

from zcode.errors import ValidationError
from zcode.layers.attention import Attention


def resolve_kv_dtype(name: str, model: nn.Module) -> torch.dtype:
    """The dtype of the model's KV cache for EngineConfig.kv_cache_dtype `name`: the dtype the
    model computes in ("auto"), or one narrower than an fp32 model's (GQA keys and values, MLA's
    latent and DSA's index keys, each read widened exactly). ValidationError for a cache wider
    than the activations."""
    computes_in = model.model.norm.weight.dtype
    if name == "auto" or getattr(torch, name) == computes_in:
        return computes_in
    if computes_in != torch.float32:
        raise ValidationError(
            f"kv_cache_dtype={name} for a model that computes in {computes_in}: only an fp32 "
            "model's KV cache may be narrower than its activations"
        )
    return getattr(torch, name)


def cache_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model's KV cache holds: its cache tensors' once an engine has bound them,
    else the dtype the model computes in."""
    for layer in model.attention_layers():
        for tensor in getattr(layer, "cache", {}).values():
            return tensor.dtype
    return model.model.norm.weight.dtype


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
        self.pages: torch.Tensor | None = None  # with shared_pages: the one page tensor
        if shared_pages:
            spec, _ = page_layout(attention_layers)
            pages = {
                name: torch.zeros(num_blocks, block_size, *shape, dtype=dtype)
                for name, shape in spec.items()
            }
            for layer in attention_layers:
                _bind(layer, pages if layer.cache_spec() else {})
            self.pages = pages["kv"]
            return
        for layer in attention_layers:
            _bind(layer, {
                name: torch.zeros(num_blocks, block_size, *shape, dtype=dtype)
                for name, shape in layer.cache_spec().items()
            })  # fmt: skip

    @staticmethod
    def num_blocks_for(
        memory_bytes: int, attention_layers: list[nn.Module], block_size: int, dtype: torch.dtype
    ) -> int:
        return max(1, memory_bytes // (kv_bytes_per_token(attention_layers, dtype) * block_size))


def _bind(layer: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Puts `tensors` in the layer's cache dict, in place: a second module tree over the model
    (a self-draft, zcode.quant.variants.copy_with) shares that dict, and so reads and writes the
    KV of the engine built last, as the model does (engines over one model take turns; a new
    dict would leave the copy on the KV of an earlier engine, drafting without the prompt)."""
    cache = vars(layer).get("cache")
    if isinstance(cache, dict):
        cache.clear()
        cache.update(tensors)
    else:
        layer.cache = dict(tensors)


def page_layout(attention_layers: list[nn.Module]) -> tuple[dict[str, tuple], list[int]]:
    """(per-token spec of one KV head's page, KV heads of each layer) for GQA layers, whose KV is
    paged per head; a layer that caches nothing has none. NotImplementedError otherwise."""
    specs, heads = set(), []
    for layer in attention_layers:
        if not layer.cache_spec():
            heads.append(0)
            continue
        if type(layer) is not Attention:
            raise NotImplementedError(
                f"KV pages per head for {type(layer).__name__}: only GQA attention is paged so"
            )
        specs.add(layer.head_dim)
        heads.append(layer.num_kv_heads)
    if len(specs) != 1:
        raise NotImplementedError("KV pages per head for layers of different head sizes")
    return {"kv": (2, 1, specs.pop())}, heads

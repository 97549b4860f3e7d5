"""Sharding a loaded model for tensor parallelism: each rank keeps only its slice of every weight.

Attention splits by heads: q/k/v keep the rows of the rank's heads (column-parallel), o_proj the
matching input columns (row-parallel, all-reduced). KV heads are split in whole GQA groups, so
each rank's query heads read only its own KV heads and its paged KV cache holds only those;
with fewer KV heads than ranks, each KV head is replicated on world_size / num_kv_heads ranks.
The SwiGLU FFN splits its intermediate features the same way (gate/up rows, down_proj columns).
MLA (glm_moe_dsa) splits by heads too: q_b_proj and kv_b_proj keep the rows of the rank's heads,
o_proj their columns; the latent projections (q_a, kv_a) and the DSA indexer are replicated
(small), so every rank computes and caches the whole latent (the MLA cache is replicated).
A MoE layer keeps the router replicated and the shared expert sliced as a dense FFN; its routed
experts are sliced the same way (tensor parallel) or, with expert parallelism, held whole, a
contiguous range of them per rank (`ParallelMoE`).
The embedding and lm_head split the vocabulary. Uneven splits give the larger pieces to the
lower ranks, so rank 0 (whose scheduler hands out KV blocks) holds the most KV per block.

Slices are copies that own their memory, and the whole weights are dropped: a safetensors view
or a GGUF file's bytes are then no longer mapped by this rank. A GGUF row is a run of blocks,
so rows split anywhere and columns only at block boundaries. Copying a row-parallel weight's
columns touches every page of it, so once the vocabulary, then each layer, is cut, the rank lets
go of the file pages of the whole weights (zcode.loader.pages): a rank's peak resident memory is
its shard plus about one layer, not the model. The vocabulary goes first, while the shard is
still small: its matrices are the largest.
"""

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import nn

from zcode.distributed.group import TPGroup
from zcode.distributed.layers import (
    ParallelMoE,
    RowParallel,
    VocabParallelEmbedding,
    VocabParallelHead,
)
from zcode.layers.attention import Attention
from zcode.layers.linear import Linear
from zcode.layers.mla import MLAttention
from zcode.layers.mlp import GatedMLP, GeluGatedMLP
from zcode.layers.moe import MoE
from zcode.loader import pages
from zcode.quant.gguf import GgufEmbedding, GgufWeight, has_interleaved_layout, type_name
from zcode.quant.linear import QuantizedLinear


@dataclass(frozen=True)
class HeadShard:
    q_heads: range
    kv_heads: range


def split_sizes(total: int, parts: int, multiple: int = 1) -> list[int]:
    """`total` in `parts` pieces of whole `multiple`s, as even as possible, larger ones first."""
    units, rest = divmod(total, multiple)
    if rest or units < parts:
        raise NotImplementedError(
            f"splitting over {parts} ranks: {total} does not split into {parts} "
            f"pieces of whole multiples of {multiple}"
        )
    base, extra = divmod(units, parts)
    return [(base + (i < extra)) * multiple for i in range(parts)]


def head_shards(num_heads: int, num_kv_heads: int, world_size: int) -> list[HeadShard]:
    """Per rank, its query heads and the KV heads they read."""
    group_size = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= world_size:
        shards, kv_start = [], 0
        for n in split_sizes(num_kv_heads, world_size):
            kv = range(kv_start, kv_start + n)
            shards.append(HeadShard(range(kv.start * group_size, kv.stop * group_size), kv))
            kv_start += n
        return shards
    if world_size % num_kv_heads or num_heads % world_size:
        raise NotImplementedError(
            f"tensor parallelism over {world_size} ranks with {num_kv_heads} KV heads: "
            "replicating KV heads needs world_size a multiple of num_kv_heads and num_heads "
            "a multiple of world_size"
        )
    q_per_rank, copies = num_heads // world_size, world_size // num_kv_heads
    return [
        HeadShard(range(r * q_per_rank, (r + 1) * q_per_rank), range(r // copies, r // copies + 1))
        for r in range(world_size)
    ]


def shard_model(model: nn.Module, group: TPGroup, expert_parallel: bool = False) -> None:
    """Replaces `model`'s layers by this rank's shards, in place. `expert_parallel`: MoE layers
    keep whole routed experts, a range per rank, instead of every expert's slice."""
    _shard_vocab(model, group)  # first: its whole matrices are the largest in flight
    for layer in model.model.layers:
        whole = _tensors_of(layer)
        _shard_attention(layer.self_attn, group, model.config.model_type)
        if type(layer.mlp) is MoE:
            layer.mlp = shard_moe(layer.mlp, group, expert_parallel)
        else:
            _shard_mlp(layer.mlp, group, model.config.model_type)
        pages.release(whole)
    own_memory(model)


def _tensors_of(module: nn.Module) -> list[torch.Tensor]:
    """The tensors `module` holds: parameters, buffers and GGUF weights' bytes."""
    tensors = list(module.parameters()) + list(module.buffers())
    for sub in module.modules():
        if isinstance(sub, (QuantizedLinear, GgufEmbedding)) and isinstance(sub.packed, GgufWeight):
            tensors.append(sub.packed.data)
    return tensors


def own_memory(model: nn.Module) -> None:
    """Copies the replicated tensors (norms, biases) that are still views of the checkpoint
    file, so that nothing keeps the whole file mapped."""
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for tensor in tensors.values():
                if tensor is not None and tensor.untyped_storage().nbytes() > tensor.nbytes:
                    tensor.data = tensor.data.clone()


def _shard_attention(attn: nn.Module, group: TPGroup, model_type: str) -> None:
    if type(attn) is MLAttention:
        _shard_mla(attn, group)
        return
    if type(attn) is not Attention:
        raise NotImplementedError(
            f"tensor parallelism for {type(attn).__name__} ({model_type}): no split for this "
            "attention (issue 19); run it with tensor_parallel_size=1"
        )
    shard = head_shards(attn.num_heads, attn.num_kv_heads, group.world_size)[group.rank]
    d = attn.head_dim
    q_rows = torch.arange(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv_rows = torch.arange(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    attn.q_proj = slice_rows(attn.q_proj, q_rows)
    attn.k_proj = slice_rows(attn.k_proj, kv_rows)
    attn.v_proj = slice_rows(attn.v_proj, kv_rows)
    attn.o_proj = row_parallel(attn.o_proj, shard.q_heads.start * d, shard.q_heads.stop * d, group)
    attn.num_heads, attn.num_kv_heads = len(shard.q_heads), len(shard.kv_heads)


def _shard_mla(attn: MLAttention, group: TPGroup) -> None:
    sizes = split_sizes(attn.num_heads, group.world_size)
    first = sum(sizes[: group.rank])
    heads = torch.arange(first, first + sizes[group.rank])

    def rows_of(heads: torch.Tensor, per_head: int) -> torch.Tensor:
        return (heads[:, None] * per_head + torch.arange(per_head)).flatten()

    attn.q_b_proj = slice_rows(attn.q_b_proj, rows_of(heads, attn.nope_dim + attn.rope_dim))
    attn.kv_b_proj = slice_rows(attn.kv_b_proj, rows_of(heads, attn.nope_dim + attn.v_dim))
    v_start, v_stop = first * attn.v_dim, (first + len(heads)) * attn.v_dim
    attn.o_proj = row_parallel(attn.o_proj, v_start, v_stop, group)
    attn.num_heads = len(heads)


def shard_moe(moe: MoE, group: TPGroup, expert_parallel: bool) -> ParallelMoE:
    """This rank's part of a MoE layer: the router whole, the shared expert's slice, and every
    routed expert's slice or (expert parallel) a contiguous range of whole experts, the larger
    ranges on the lower ranks."""
    if expert_parallel:
        sizes = split_sizes(len(moe.experts), group.world_size)
        first_expert = sum(sizes[: group.rank])
        moe.experts = nn.ModuleList(moe.experts[first_expert : first_expert + sizes[group.rank]])
    else:
        first_expert = 0
        for expert in moe.experts:
            _slice_partial_ffn(expert, group)
    _slice_partial_ffn(moe.shared_experts, group)
    return ParallelMoE(moe, first_expert, group)


def _slice_partial_ffn(mlp: nn.Module, group: TPGroup) -> None:
    """The FFN's slice of its intermediate features, whose output is this rank's share of a sum
    that `ParallelMoE` completes."""
    start, stop = _slice_ffn_inputs(mlp, group, "MoE")
    if mlp.down_proj.bias is not None:
        raise NotImplementedError("tensor-parallel MoE experts with a down_proj bias")
    mlp.down_proj = slice_columns(mlp.down_proj, start, stop)


def _shard_mlp(mlp: nn.Module, group: TPGroup, model_type: str) -> None:
    start, stop = _slice_ffn_inputs(mlp, group, model_type)
    mlp.down_proj = row_parallel(mlp.down_proj, start, stop, group)


def _slice_ffn_inputs(mlp: nn.Module, group: TPGroup, model_type: str) -> tuple[int, int]:
    """Keeps the gate/up rows of this rank's intermediate features; returns their [start, stop),
    the down_proj columns that go with them."""
    if type(mlp) in (GatedMLP, GeluGatedMLP):
        start, stop = _feature_range(mlp.gate_proj.out_features, mlp.down_proj, group)
        rows = torch.arange(start, stop)
        mlp.gate_proj = slice_rows(mlp.gate_proj, rows)
        mlp.up_proj = slice_rows(mlp.up_proj, rows)
    else:
        raise NotImplementedError(
            f"tensor parallelism for {type(mlp).__name__} ({model_type}): no split for this "
            "FFN (issue 19); run it with tensor_parallel_size=1"
        )
    return start, stop


def _feature_range(size: int, row_linear: nn.Module, group: TPGroup) -> tuple[int, int]:
    """This rank's [start, stop) of `size` features, cut where `row_linear`'s columns split."""
    sizes = split_sizes(size, group.world_size, _column_multiple(row_linear))
    start = sum(sizes[: group.rank])
    return start, start + sizes[group.rank]


def _shard_vocab(model: nn.Module, group: TPGroup) -> None:
    embed, head = model.model.embed_tokens, model.lm_head
    sizes = split_sizes(embed.num_embeddings, group.world_size)
    start = sum(sizes[: group.rank])
    rows = torch.arange(start, start + sizes[group.rank])
    tied = _weight_of(head) is _weight_of(embed)
    local_embed = _slice_embedding(embed, rows)
    pages.release(_tensors_of(embed))
    if tied and isinstance(local_embed, GgufEmbedding):
        local_head = QuantizedLinear(local_embed.packed, None, head.format)
    elif tied:
        local_head = Linear(embed.embedding_dim, len(rows), bias=False, device="meta")
        local_head.weight = local_embed.weight
    else:
        local_head = slice_rows(head, rows)
        pages.release(_tensors_of(head))
    model.model.embed_tokens = VocabParallelEmbedding(local_embed, start, group)
    model.lm_head = VocabParallelHead(local_head, sizes, group)


# -- slicing one module


def slice_rows(linear: nn.Module, rows: torch.Tensor) -> nn.Module:
    """The linear restricted to output features `rows` (column-parallel), owning its memory."""
    bias = None if linear.bias is None else _param(linear.bias.index_select(0, rows), linear.bias)
    if isinstance(linear, QuantizedLinear) and isinstance(linear.packed, GgufWeight):
        packed = linear.packed
        weight = _rank_weight(_file_rows(packed, rows), packed, packed.in_features)
        return QuantizedLinear(weight, bias, linear.format, linear.kernel)
    _check_float(linear)
    out = Linear(linear.in_features, len(rows), bias=False, device="meta")
    out.weight = _param(linear.weight.index_select(0, rows), linear.weight)
    out.bias = bias
    return out


def row_parallel(linear: nn.Module, start: int, stop: int, group: TPGroup) -> RowParallel:
    """The linear restricted to input features [start, stop), its outputs summed over ranks."""
    bias = None if linear.bias is None else linear.bias.detach().clone()
    return RowParallel(slice_columns(linear, start, stop), bias, group)


def slice_columns(linear: nn.Module, start: int, stop: int) -> nn.Module:
    """The linear restricted to input features [start, stop), without its bias, owning its
    memory: a partial product that a sum over the ranks completes."""
    if isinstance(linear, QuantizedLinear) and isinstance(linear.packed, GgufWeight):
        packed = linear.packed
        block_size, block_bytes = _block(packed)
        if start % block_size or stop % block_size:
            raise NotImplementedError(
                f"row-parallel {type_name(packed.ggml_type)} weight: its rows split only at "
                f"whole blocks of {block_size} columns, this rank's columns are [{start}, {stop})"
            )
        cols = slice(start // block_size * block_bytes, stop // block_size * block_bytes)
        chunks = range(0, packed.out_features, _CHUNK_ROWS)  # in the file's order, a chunk at once
        data = torch.cat([packed.file_rows(r, r + _CHUNK_ROWS)[:, cols] for r in chunks])
        weight = _rank_weight(data, packed, stop - start)
        return QuantizedLinear(weight, None, linear.format, linear.kernel)
    _check_float(linear)
    local = Linear(stop - start, linear.out_features, bias=False, device="meta")
    local.weight = _param(linear.weight[:, start:stop].clone(), linear.weight)
    return local


def _slice_embedding(embed: nn.Module, rows: torch.Tensor) -> nn.Module:
    if isinstance(embed, GgufEmbedding):
        packed = embed.packed
        weight = _rank_weight(_file_rows(packed, rows), packed, packed.in_features)
        return GgufEmbedding(weight)
    if type(embed) is not nn.Embedding:
        raise NotImplementedError(f"a vocab-parallel {type(embed).__name__}")
    out = nn.Embedding(len(rows), embed.embedding_dim, device="meta")
    out.weight = _param(embed.weight.index_select(0, rows), embed.weight)
    return out


# Rows of an interleaved weight put back in the file's order (or a slice interleaved again) at a
# time: a weight is never held twice while it is cut.
_CHUNK_ROWS = 1024


def _file_rows(packed: GgufWeight, rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows `rows` of `packed` in the file's order, owning their memory."""
    first, stop = int(rows.min()), int(rows.max()) + 1
    span = packed.file_rows(first, stop)
    if len(rows) == stop - first and bool((rows == torch.arange(first, stop)).all()):
        return span if packed.interleaved else span.clone()  # interleaved: already a copy
    return span.index_select(0, rows - first)


def _rank_weight(data: torch.Tensor, whole: GgufWeight, in_features: int) -> GgufWeight:
    """A rank's slice of `whole` (uint8 rows in the file's order, owned) as a GgufWeight,
    interleaved in place a chunk of rows at a time where `whole` was: the rank runs the kernels
    one process runs, and its sums differ from one process's only by the all-reduce."""
    ggml_type = whole.ggml_type
    if not (whole.interleaved and has_interleaved_layout(ggml_type, len(data))):
        return GgufWeight(data, ggml_type, in_features)
    for r in range(0, len(data), _CHUNK_ROWS):
        chunk = data[r : r + _CHUNK_ROWS]
        chunk.copy_(torch.ops.zcode.ggml_interleave(chunk, ggml_type, in_features))
    return GgufWeight(data, ggml_type, in_features, interleaved=True)


def _column_multiple(linear: nn.Module) -> int:
    """The granularity the linear's input features can be split at."""
    if isinstance(linear, QuantizedLinear) and isinstance(linear.packed, GgufWeight):
        return _block(linear.packed)[0]
    return 1


def _block(packed: GgufWeight) -> tuple[int, int]:
    """(columns, bytes) of one block of the weight's ggml type."""
    return GGML_QUANT_SIZES[GGMLQuantizationType(packed.ggml_type)]


def _weight_of(module: nn.Module) -> torch.Tensor | None:
    if isinstance(module, (QuantizedLinear, GgufEmbedding)):
        return getattr(module.packed, "data", None)
    return getattr(module, "weight", None)


def _check_float(linear: nn.Module) -> None:
    if not isinstance(linear, nn.Linear):
        raise NotImplementedError(
            f"tensor parallelism for a {type(linear).__name__} "
            f"({getattr(linear, 'format', 'unknown format')}): only float and GGUF weights split"
        )


def _param(value: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(value.contiguous(), requires_grad=like.requires_grad)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the tensors `model` holds (parameters and buffers, each storage once): what one
    rank keeps resident, the KV cache aside."""
    storages = {}
    for tensor in list(model.parameters()) + list(model.buffers()):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())

"""KV pages per layer and KV head, for requests that skip decoder layers or KV heads for their
whole lifetime.

With a shared block table every layer stores every block, so a request that never runs layer l
(or never reads KV head g of it) would still hold that KV memory. Here the KV memory is one pool
of pages shared by all layers, each page holding one KV head of one layer for `block_size`
tokens: a unit is a (layer, KV head) pair. A block of the block manager is a logical block, and
it holds one page for each unit its sequence keeps:

    page table   table[unit, block] -> page     (0: the null page, for units the block skips)
    KV slot      table[unit, slot // block_size] * block_size + slot % block_size

Page 0 is never handed out: a layer or head some batch members skip still runs for the others,
and the skipping members' rows write and read the null page, and their results are dropped.
"""

import dataclasses
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from zcode.layers.attention import write_cache

NULL_PAGE = 0
MAX_KEPT_PLANS = 1024


class PagePool:
    def __init__(self, heads_per_layer: list[int], num_pages: int, num_blocks: int) -> None:
        """heads_per_layer: KV heads of each layer (0 for a layer that caches nothing);
        num_pages: pages including the null page; num_blocks: logical blocks the block manager
        hands out (the table has one more column, for the padding block, which maps to null)."""
        if num_pages < 2:
            raise ValueError(f"a page pool needs the null page and one more, got {num_pages}")
        self.heads_per_layer, self.num_pages = heads_per_layer, num_pages
        self.first_unit = [sum(heads_per_layer[:i]) for i in range(len(heads_per_layer))]
        self.num_units = sum(heads_per_layer)
        self.table = torch.full((self.num_units, num_blocks + 1), NULL_PAGE, dtype=torch.int64)
        self.free_pages: deque[int] = deque(range(1, num_pages))
        self.pages_of: list[list[int]] = [[] for _ in range(num_blocks)]  # logical block -> pages
        self._units: dict[tuple[frozenset, frozenset], list[int]] = {}

    @property
    def num_layers(self) -> int:
        return len(self.heads_per_layer)

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def units(
        self, skip_layers: frozenset[int], skip_heads: frozenset[tuple[int, int]]
    ) -> list[int]:
        """The units a sequence keeps that skips these layers and (layer, KV head) pairs."""
        key = (skip_layers, skip_heads)
        if key not in self._units:  # asked for every sequence at every step: kept
            if len(self._units) >= MAX_KEPT_PLANS:  # clients choose the keys: bounded
                self._units.clear()
            self._units[key] = self._kept_units(skip_layers, skip_heads)
        return self._units[key]

    def _kept_units(
        self, skip_layers: frozenset[int], skip_heads: frozenset[tuple[int, int]]
    ) -> list[int]:
        skipped = {(i, g) for i in skip_layers for g in range(self.heads_per_layer[i])}
        skipped |= skip_heads
        return [
            self.first_unit[i] + g
            for i, num_heads in enumerate(self.heads_per_layer)
            for g in range(num_heads)
            if (i, g) not in skipped
        ]

    def held(self, block_id: int) -> int:
        return len(self.pages_of[block_id])

    def assign(self, block_id: int, units: list[int]) -> None:
        """Gives logical block `block_id` a page in each of `units` (check num_free_pages)."""
        assert not self.pages_of[block_id], f"block {block_id} already holds pages"
        pages = [self.free_pages.popleft() for _ in units]
        self.pages_of[block_id] = pages
        self.table[units, block_id] = torch.tensor(pages, dtype=torch.int64)

    def release(self, block_id: int) -> None:
        self.free_pages.extend(self.pages_of[block_id])
        self.pages_of[block_id] = []
        self.table[:, block_id] = NULL_PAGE


@dataclass(frozen=True)
class LayerPaging:
    """What a forward pass over KV pages needs: each unit's KV slots, and which rows skip which
    layers and KV heads. Carried by ForwardBatch.paging; Backbone runs each layer through `run`,
    which hands the layer a batch whose slots are [T, KVH] and [B, L_max, KVH] (one column per
    KV head) and whose `kv_head_keep` masks the heads a row's request skips."""

    pool: PagePool
    pages: torch.Tensor  # [num_pages, block_size, 2, 1, D], the page tensor all layers share
    slot_mapping: torch.Tensor  # [U, T] int64, the batch's slot_mapping in each unit's pages
    context_slots: torch.Tensor  # [U, B, L_max] int64, likewise for its context_slots
    skipped_by_all: frozenset[int]  # layers no sequence of the batch runs
    keep_rows: dict[int, torch.Tensor]  # layer -> [T] bool, rows of sequences that skip it
    head_keep: dict[int, torch.Tensor]  # layer -> [T, KVH] bool, False: the row skips the head
    # (slots [T, KVH], KV [T, 2, KVH, D]) of each layer run, written by `write_pending` after
    # the last layer.
    pending: list[tuple[torch.Tensor, torch.Tensor]] = dataclasses.field(default_factory=list)

    @classmethod
    def build(
        cls,
        pool: PagePool,
        pages: torch.Tensor,
        block_size: int,
        batch,
        skip_layers: list[frozenset[int]],
        skip_heads: list[frozenset[tuple[int, int]]],
        query_lens: list[int],
    ) -> "LayerPaging":
        """skip_layers[b], skip_heads[b]: what sequence b of `batch` skips; it brings
        query_lens[b] packed tokens."""
        lens = torch.tensor(query_lens)
        union = frozenset().union(*skip_layers)
        by_all = frozenset(i for i in union if all(i in s for s in skip_layers))
        keep_rows = {
            i: torch.tensor([i in s for s in skip_layers]).repeat_interleave(lens)
            for i in union - by_all
        }
        head_keep = {}
        for i in {i for heads in skip_heads for i, _ in heads} - by_all:
            keep = [[(i, g) not in s for g in range(pool.heads_per_layer[i])] for s in skip_heads]
            head_keep[i] = torch.tensor(keep).repeat_interleave(lens, dim=0)  # [T, KVH]
        # Every unit's slots at once: one gather a step instead of a few small ops per layer.
        slot_mapping = _physical(pool.table, batch.slot_mapping, block_size)
        context_slots = _physical(pool.table, batch.context_slots, block_size)
        return cls(pool, pages, slot_mapping, context_slots, by_all, keep_rows, head_keep)

    def run(self, index: int, layer: nn.Module, x: torch.Tensor, batch, rope) -> torch.Tensor:
        """Decoder layer `index` on x [T, D] -> [T, D], with its own KV slots; rows of sequences
        that skip it come out as they went in."""
        if index in self.skipped_by_all:
            return x
        units = slice(
            self.pool.first_unit[index],
            self.pool.first_unit[index] + self.pool.heads_per_layer[index],
        )
        own = dataclasses.replace(
            batch,
            slot_mapping=self.slot_mapping[units].t(),  # [T, KVH]
            context_slots=self.context_slots[units].permute(1, 2, 0),  # [B, L_max, KVH]
            kv_head_keep=self.head_keep.get(index),
        )
        out = layer(x, own, rope)
        keep = self.keep_rows.get(index)
        return out if keep is None else torch.where(keep[:, None], x, out)

    def write_pending(self) -> None:
        """Writes the KV of every layer run in one scatter: inductor turns one write of a graph
        input into an in-place scatter, but copied the whole page tensor when each layer wrote
        (SmolLM2, 256 MB of pages: 111 ms a compiled step against 21)."""
        slots = torch.cat([s.reshape(-1) for s, _ in self.pending])  # [N = layers * T * KVH]
        kv = torch.cat([v.movedim(2, 1).flatten(0, 1) for _, v in self.pending])  # [N, 2, D]
        write_cache(self.pages, kv[:, :, None], slots)
        self.pending.clear()


def _physical(table: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    # table: [U, blocks + 1]; logical slots [*shape] -> each unit's slots [U, *shape]
    return table[:, slots // block_size] * block_size + slots % block_size

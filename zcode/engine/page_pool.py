"""Per-layer KV pages, for requests that skip decoder layers for their whole lifetime.

With a shared block table every layer stores every block, so a request that never runs layer l
would still hold layer l's KV memory. Here the KV memory is one pool of pages, each holding one
layer's KV of `block_size` tokens, shared by all layers; a block of the block manager is a
logical block, and it holds one page for each layer its sequence runs:

    page table   table[l, block] -> page     (0: the null page, for layers the block skips)
    KV slot      table[l, slot // block_size] * block_size + slot % block_size

Page 0 is never handed out: a layer some batch members skip still runs for the others, and the
skipping members' rows write and read the null page, and their results are dropped
(`PagedLayer`).
"""

import dataclasses
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

NULL_PAGE = 0


class PagePool:
    def __init__(self, num_layers: int, num_pages: int, num_blocks: int) -> None:
        """num_pages: pages including the null page; num_blocks: logical blocks the block manager
        hands out (the table has one more column, for the padding block, which maps to null)."""
        if num_pages < 2:
            raise ValueError(f"a page pool needs the null page and one more, got {num_pages}")
        self.num_layers, self.num_pages = num_layers, num_pages
        self.table = torch.full((num_layers, num_blocks + 1), NULL_PAGE, dtype=torch.int64)
        self.free_pages: deque[int] = deque(range(1, num_pages))
        self.pages_of: list[list[int]] = [[] for _ in range(num_blocks)]  # logical block -> pages

    @property
    def num_free_pages(self) -> int:
        return len(self.free_pages)

    def held(self, block_id: int) -> int:
        return len(self.pages_of[block_id])

    def assign(self, block_id: int, layers: list[int]) -> None:
        """Gives logical block `block_id` a page in each of `layers` (check num_free_pages)."""
        assert not self.pages_of[block_id], f"block {block_id} already holds pages"
        pages = [self.free_pages.popleft() for _ in layers]
        self.pages_of[block_id] = pages
        self.table[layers, block_id] = torch.tensor(pages, dtype=torch.int64)

    def release(self, block_id: int) -> None:
        self.free_pages.extend(self.pages_of[block_id])
        self.pages_of[block_id] = []
        self.table[:, block_id] = NULL_PAGE


@dataclass(frozen=True)
class LayerPaging:
    """What a forward pass over per-layer pages needs: each layer's KV slots, and which rows skip
    which layers. Carried by ForwardBatch.paging; Backbone runs each layer through `run`."""

    slot_mapping: torch.Tensor  # [L, T] int64, the batch's slot_mapping in each layer's pages
    context_slots: torch.Tensor  # [L, B, L_max] int64, likewise for its context_slots
    skipped_by_all: frozenset[int]  # layers no sequence of the batch runs
    keep_rows: dict[int, torch.Tensor]  # layer -> [T] bool, rows of sequences that skip it

    @classmethod
    def build(
        cls,
        pool: PagePool,
        block_size: int,
        batch,
        skip_layers: list[frozenset[int]],
        query_lens: list[int],
    ) -> "LayerPaging":
        """skip_layers[b]: the layers sequence b of `batch` skips; it brings query_lens[b]
        packed tokens."""
        union = frozenset().union(*skip_layers)
        by_all = frozenset(i for i in union if all(i in s for s in skip_layers))
        lens = torch.tensor(query_lens)
        keep_rows = {
            i: torch.tensor([i in s for s in skip_layers]).repeat_interleave(lens)
            for i in union - by_all
        }
        # Every layer's slots at once: one gather a step instead of a few small ops per layer.
        slot_mapping = _physical(pool.table, batch.slot_mapping, block_size)
        context_slots = _physical(pool.table, batch.context_slots, block_size)
        return cls(slot_mapping, context_slots, by_all, keep_rows)

    def run(self, index: int, layer: nn.Module, x: torch.Tensor, batch, rope) -> torch.Tensor:
        """Decoder layer `index` on x [T, D] -> [T, D], with its own KV slots; rows of sequences
        that skip it come out as they went in."""
        if index in self.skipped_by_all:
            return x
        own = dataclasses.replace(
            batch, slot_mapping=self.slot_mapping[index], context_slots=self.context_slots[index]
        )
        out = layer(x, own, rope)
        keep = self.keep_rows.get(index)
        return out if keep is None else torch.where(keep[:, None], x, out)


def _physical(table: torch.Tensor, slots: torch.Tensor, block_size: int) -> torch.Tensor:
    # table: [L, blocks + 1]; logical slots [*shape] -> each layer's slots [L, *shape]
    return table[:, slots // block_size] * block_size + slots % block_size

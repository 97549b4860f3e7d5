"""Hands out fixed-size KV blocks to sequences, shares cached prefixes and takes blocks back.

Prefix caching (vLLM v1 style): a full block is named by the hash of its tokens chained with its
predecessor's hash, so equal hashes mean equal tokens at equal positions after an equal prefix,
hence equal KV. Blocks are reference counted. A block whose last user leaves keeps its content
and stays findable by hash in an LRU pool until a new allocation needs it; a block that never
got a hash goes straight back to the free list.

    block state         ref_count   hash   where
    in use              > 0         any    some sequences' block tables
    cached, evictable   0           set    `evictable` (LRU first) and `hash_to_block_id`
    free                0           None   `free_block_ids`

Blocks are published to the cache only once their KV has been computed (`cache_full_blocks`),
never at allocation, so a failed or preempted step cannot leave a findable block of garbage.
Drafted tokens of speculative decoding are not in a sequence's tokens, nor counted as computed,
until accepted; blocks that held only rejected ones are given back by `trim`.

A sequence's cache salt (vLLM's `cache_salt`) roots its chain of hashes: requests share blocks
only under equal salts. The engine salts what computes KV differently from the model it was
built with (an FFN sparsity level, skipped layers or KV heads), and a server client may salt its
requests so that no other tenant can reuse, or time, its prefixes.

With a PagePool (per-request layer and head skipping) a block is a logical block that holds one
KV page per (layer, KV head) its sequence keeps, taken when the block is taken and given back
when the block is freed or evicted; capacity is then counted in pages as well as in blocks.
"""

import hashlib
import json
from array import array
from collections import OrderedDict, deque

from zcode.engine.page_pool import PagePool
from zcode.engine.sequence import Sequence


def hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
    # sha256 rather than hash(): a collision would hand one request another request's KV.
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def join_salts(*salts: str | None) -> str:
    """One salt naming all of these (order matters); empty when none is set."""
    return json.dumps(salts) if any(salts) else ""


def root_hash(cache_salt: str) -> bytes:
    """The parent hash of a sequence's first block: empty unsalted, as before salts existed."""
    return hashlib.sha256(b"cache salt\0" + cache_salt.encode()).digest() if cache_salt else b""


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        pages: PagePool | None = None,
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pages = pages
        self.evictable_pages = 0  # pages held by evictable blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.hash_to_block_id: dict[bytes, int] = {}
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self.prefix_cache_queries = 0  # tokens of admitted sequences looked up in the cache
        self.prefix_cache_hits = 0  # of those, tokens whose KV was reused

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: truly free plus cached-but-evictable."""
        return len(self.free_block_ids) + len(self.evictable)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks (of pages, with a page pool) held by sequences; evictable cached
        blocks count as free."""
        if self.pages is not None:
            free = self.pages.num_free_pages + self.evictable_pages
            return 1.0 - free / (self.pages.num_pages - 1)
        return 1.0 - self.num_free_blocks / self.num_blocks

    def kv_units(self, seq: Sequence) -> list[int]:
        """The page-pool units (layer, KV head) whose KV `seq` keeps; needs a page pool."""
        return self.pages.units(seq.skip_layers, seq.skip_kv_heads)

    def max_blocks(self, seq: Sequence) -> int:
        """The most blocks `seq` could hold in an otherwise empty cache."""
        if self.pages is None:
            return self.num_blocks
        return min(self.num_blocks, (self.pages.num_pages - 1) // len(self.kv_units(seq)))

    def uses_prefix_cache(self, seq: Sequence) -> bool:
        # Prompt log-probabilities need the logits of every prompt token: nothing may be skipped.
        return self.enable_prefix_caching and not seq.wants_prompt_logprobs

    def cached_prefix(self, seq: Sequence) -> tuple[int, ...]:
        """Cached blocks holding the longest prefix of `seq`'s tokens, for admission.

        At least one token is left to compute so that the step yields logits; capping at a block
        boundary below the token count means the recomputed tokens never land in a shared block.
        """
        if not self.uses_prefix_cache(seq):
            return ()
        max_blocks = (seq.num_tokens - 1) // self.block_size
        block_ids = []
        for block_hash in self._hashes(seq, max_blocks)[:max_blocks]:
            block_id = self.hash_to_block_id.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return tuple(block_ids)

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, num_cached_blocks: int = 0) -> int:
        num_tokens = seq.num_computed_tokens + num_cached_blocks * self.block_size + num_new_tokens
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table) - num_cached_blocks)

    def can_allocate(
        self, seq: Sequence, num_new_tokens: int, prefix_block_ids: tuple[int, ...] = ()
    ) -> bool:
        # Evictable blocks reused as a prefix stop being free once taken.
        reclaimed = [b for b in prefix_block_ids if self.ref_counts[b] == 0]
        needed = self.blocks_needed(seq, num_new_tokens, len(prefix_block_ids))
        if needed > self.num_free_blocks - len(reclaimed):
            return False
        if self.pages is None:
            return True
        free_pages = self.pages.num_free_pages + self.evictable_pages
        free_pages -= sum(self.pages.held(b) for b in reclaimed)
        return needed * len(self.kv_units(seq)) <= free_pages

    def allocate(
        self, seq: Sequence, num_new_tokens: int, prefix_block_ids: tuple[int, ...] = ()
    ) -> None:
        """Grows `seq`'s block table for `num_new_tokens` more tokens.

        On admission (`seq` holds no blocks yet) `prefix_block_ids` from `cached_prefix` become
        the head of its table and count as computed.
        """
        assert self.can_allocate(seq, num_new_tokens, prefix_block_ids), "check can_allocate"
        if not seq.block_table:
            assert seq.num_computed_tokens == 0
            if self.uses_prefix_cache(seq):
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += len(prefix_block_ids) * self.block_size
            for block_id in prefix_block_ids:
                if self.ref_counts[block_id] == 0:
                    self._unmark_evictable(block_id)
                self.ref_counts[block_id] += 1
            seq.block_table = list(prefix_block_ids)
            seq.num_hashed_blocks = len(prefix_block_ids)
            seq.num_cached_tokens = seq.num_computed_tokens = len(seq.block_table) * self.block_size
        else:
            assert not prefix_block_ids, "a cached prefix is only taken on admission"
        for _ in range(self.blocks_needed(seq, num_new_tokens)):
            seq.block_table.append(self._take_free_block(seq))

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Publishes `seq`'s full blocks whose KV is computed, so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        num_full = seq.num_computed_tokens // self.block_size
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            block_id, block_hash = seq.block_table[i], hashes[i]
            # The same content computed twice (e.g. by two requests admitted together) is
            # cached once; the duplicate block is freed as uncached.
            if self.block_hashes[block_id] is None and block_hash not in self.hash_to_block_id:
                self.block_hashes[block_id] = block_hash
                self.hash_to_block_id[block_hash] = block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, num_full)

    def free(self, seq: Sequence) -> None:
        """Releases `seq`'s blocks (finish, abort, preemption); cached content stays findable."""
        self.cache_full_blocks(seq)
        # Reversed: a sequence's tail blocks are the least likely to be shared, so evict them first.
        for block_id in reversed(seq.block_table):
            self.ref_counts[block_id] -= 1
            assert self.ref_counts[block_id] >= 0, f"block {block_id} freed more than taken"
            if self.ref_counts[block_id] == 0:
                if self.block_hashes[block_id] is None:
                    self._release(block_id)
                else:
                    self.evictable[block_id] = None
                    if self.pages is not None:
                        self.evictable_pages += self.pages.held(block_id)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def trim(self, seq: Sequence) -> None:
        """Gives back the blocks past `seq`'s computed tokens (those that held rejected drafts).

        They were taken for this sequence alone and never published: a block is hashed only
        once every token in it is computed.
        """
        num_kept = -(-seq.num_computed_tokens // self.block_size)
        for block_id in seq.block_table[num_kept:]:
            assert self.ref_counts[block_id] == 1 and self.block_hashes[block_id] is None
            self.ref_counts[block_id] = 0
            self._release(block_id)
        del seq.block_table[num_kept:]

    def _take_free_block(self, seq: Sequence) -> int:
        if not self.free_block_ids:
            self._evict_oldest()
        block_id = self.free_block_ids.popleft()
        if self.pages is not None:
            units = self.kv_units(seq)
            while self.pages.num_free_pages < len(units):
                self._evict_oldest()
            self.pages.assign(block_id, units)
        self.ref_counts[block_id] = 1
        return block_id

    def _evict_oldest(self) -> None:
        block_id = next(iter(self.evictable))
        self._unmark_evictable(block_id)
        del self.hash_to_block_id[self.block_hashes[block_id]]
        self.block_hashes[block_id] = None
        self._release(block_id)

    def _unmark_evictable(self, block_id: int) -> None:
        del self.evictable[block_id]
        if self.pages is not None:
            self.evictable_pages -= self.pages.held(block_id)

    def _release(self, block_id: int) -> None:
        """A block nobody holds and the cache does not name goes back to the free list."""
        if self.pages is not None:
            self.pages.release(block_id)
        self.free_block_ids.append(block_id)

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """`seq.block_hashes`, extended to cover at least its first `num_blocks` full blocks."""
        hashes, size = seq.block_hashes, self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else root_hash(seq.cache_salt)
            hashes.append(hash_block(parent, seq.token_ids[i * size : (i + 1) * size]))
        return hashes

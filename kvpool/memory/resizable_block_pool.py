"""A block pool whose online ids change: the bookkeeping side of an elastic KV pool.

`ResizableBlockPool` starts with no block online. The elastic pool (`kvpool.memory.elastic_pool`)
brings runs of ids online (`add_blocks`) as its memory grows, takes unused ones offline
(`remove_blocks`: listeners hear `block_removed` for each cached one) as it shrinks, and moves
used blocks out of a segment it gives back (`relocate_blocks`: cached blocks evicted to take
them are `block_evicted` with their KV overwritten at once). The null block (id 0) is never
brought online. Every invariant of `BlockPool` holds after each call. Generations: an id taken
offline, or relocated away, stops naming its KV, so its generation advances then (a relocation
target's advances as it is taken, like any hand-out); bringing an id online leaves it alone.

Policy: blocks brought online go to the *bottom* of the free stack, so free blocks already
online are reused first and the newest memory stays the emptiest, the cheapest to give back.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool
from kvpool.memory.errors import InvalidBlockError, OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout


class ResizableBlockPool(BlockPool):
    """Ids `1 .. capacity_blocks - 1`, none online at first."""

    def __init__(self, capacity_blocks: int, layout: KVLayout,
                 enable_prefix_caching: bool = True) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        super().__init__(0, layout, enable_prefix_caching, capacity_blocks)

    def add_blocks(self, block_ids: Iterable[int]) -> None:
        """Bring offline ids online as free blocks, under those already free (module docstring);
        among themselves they are handed out lowest id first. All or nothing."""
        block_ids = sorted(block_ids)
        for index, block_id in enumerate(block_ids):
            if not (type(block_id) is int and NULL_BLOCK_ID < block_id < self.capacity_blocks):
                raise InvalidBlockError(f"block id {block_id!r} is outside the pool's capacity")
            if self._is_online[block_id] or (index and block_ids[index - 1] == block_id):
                raise InvalidBlockError(f"block {block_id} is already online")
        for block_id in block_ids:
            self._is_online[block_id] = True
        self._fresh_free_ids[:0] = block_ids[::-1]
        self.num_blocks += len(block_ids)

    def remove_blocks(self, block_ids: Iterable[int], is_kv_intact: bool = False) -> int:
        """Take unused online ids offline, evicting the cached ones; returns how many were.

        `is_kv_intact`: the ids' KV stays readable until the next step (a hybrid pool hands
        the page to another group, which writes it then), so listeners hear `block_evicted`
        and a tier below may still copy it; otherwise `block_removed` (a shrink's memory is
        gone). All or nothing: an id that is used or offline changes nothing and raises.
        """
        removed = set(block_ids)
        for block_id in removed:
            self._check_id(block_id)
            if self._ref_counts[block_id]:
                raise InvalidBlockError(f"cannot take block {block_id} offline: it is used")
        num_evicted = 0
        for block_id in removed:
            self._is_online[block_id] = False
            self._generations[block_id] += 1
            if block_id in self._evictable_ids:
                del self._evictable_ids[block_id]
                entry = self.prefix_cache.remove(block_id)
                assert entry is not None, "an evictable block is hashed"
                if is_kv_intact:
                    self.listeners.block_evicted(self.medium, block_id, entry, True)
                else:
                    self.listeners.block_removed(self.medium, block_id, entry.block_hash)
                self._num_filled_slots[block_id] = 0
                num_evicted += 1
        self._fresh_free_ids = [b for b in self._fresh_free_ids if b not in removed]
        self.num_blocks -= len(removed)
        self._num_evictions += num_evicted
        return num_evicted

    def relocate_blocks(self, block_ids: Sequence[int]) -> dict[int, int]:
        """Move used blocks' bookkeeping to newly taken blocks; returns old id -> new id.

        Each new block gets the old one's references, filled slots and prefix-cache entry (so a
        cached prefix still hits); each old block becomes free. The caller copies the KV data
        and remaps every block table holding an old id. New blocks come from the free blocks
        (fresh first, then evicting cached ones), never from `block_ids`; all or nothing.
        """
        for block_id in block_ids:
            self._check_referenced(block_id, "relocate")
        if len(set(block_ids)) != len(block_ids):
            raise InvalidBlockError("relocate_blocks got a block id twice")
        if len(block_ids) > self.num_allocatable_blocks:
            raise OutOfBlocksError(len(block_ids), self.num_free_blocks, self.num_cached_blocks)
        old_to_new = {old_id: self._take_one(is_kv_intact=False) for old_id in block_ids}
        for old_id, new_id in old_to_new.items():
            self._ref_counts[new_id] = self._ref_counts[old_id]
            self._num_filled_slots[new_id] = self._num_filled_slots[old_id]
            entry = self.prefix_cache.remove(old_id)
            if entry is not None:
                self.prefix_cache.insert(new_id, entry.block_hash, entry.token_ids)
            self._ref_counts[old_id] = 0
            self._num_filled_slots[old_id] = 0
            self._generations[old_id] += 1
            self._fresh_free_ids.append(old_id)
        return old_to_new

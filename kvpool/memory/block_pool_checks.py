"""`BlockPool.check_invariants`: an O(capacity_blocks) walk asserting every invariant the
block pool's module docstring states (`kvpool.memory.block_pool`), for the tests. Apart from the
pool so that its file holds what runs; it reads the pool's private lists, as a method would.
"""

from __future__ import annotations

from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool


def check_block_pool(pool: BlockPool) -> None:
    """Assert the block pool's invariants (`BlockPool.check_invariants`)."""
    fresh = set(pool._fresh_free_ids)
    evictable = set(pool._evictable_ids)
    assert len(fresh) == len(pool._fresh_free_ids), "duplicate id on the free stack"
    assert not fresh & evictable, "a block is both free and cached"
    assert sum(pool._is_online) == pool.num_blocks, "the online count is off"
    assert not pool._is_online[NULL_BLOCK_ID], "the null block is online"
    filled_in_use = 0
    for block_id, ref_count in enumerate(pool._ref_counts):
        assert ref_count >= 0
        is_hashed = pool.prefix_cache.is_cached(block_id)
        if not pool._is_online[block_id]:
            assert ref_count == 0 and not is_hashed, f"offline block {block_id} is in use"
            assert block_id not in fresh and block_id not in evictable
            assert pool._num_filled_slots[block_id] == 0
        elif ref_count > 0:
            assert block_id not in fresh and block_id not in evictable
            filled_in_use += pool._num_filled_slots[block_id]
        else:
            assert (block_id in evictable) == is_hashed
            assert (block_id in fresh) != is_hashed
    assert filled_in_use == pool._num_filled_slots_in_use
    assert pool._num_allocations - pool._num_frees == pool.num_used_blocks, "counters drift"

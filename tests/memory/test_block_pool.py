"""BlockPool on tiny pools: exact ids, reference counts, LIFO reuse, LRU eviction, errors.

Id 0 is the null block, so a new pool of n blocks hands out 1 .. n.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool
from kvpool.memory.errors import InvalidBlockError, OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import hash_full_blocks


def make_pool(num_blocks: int, block_size: int, **options) -> BlockPool:
    return BlockPool(num_blocks, KVLayout(block_size), **options)


def publish_full_block(pool: BlockPool, block_id: int, tokens: list[int]) -> bytes:
    (block_hash,) = hash_full_blocks(tokens, pool.block_size)
    assert pool.publish(block_id, block_hash, tokens)
    return block_hash


def take(pool: BlockPool, hashes: list[bytes], tokens: list[int]) -> list[int]:
    return pool.take_prefix(pool.match_prefix(hashes, tokens))


def test_new_pool_hands_out_ids_in_order_with_ref_count_one():
    pool = make_pool(8, 4)
    assert pool.allocate(3) == [1, 2, 3]
    assert [pool.ref_count(i) for i in range(1, 5)] == [1, 1, 1, 0]
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_cached_blocks) == (5, 3, 0)


def test_the_null_block_is_never_handed_out_nor_accepted():
    pool = make_pool(2, 4)
    assert sorted(pool.allocate(2)) == [1, 2] and pool.num_allocatable_blocks == 0
    for call in (pool.free, pool.retain):
        with pytest.raises(InvalidBlockError, match="null block"):
            call([NULL_BLOCK_ID])
    assert not pool.is_online(NULL_BLOCK_ID) and pool.capacity_blocks == 3
    pool.check_invariants()


def test_fresh_blocks_are_reused_last_in_first_out():
    pool = make_pool(8, 4)
    pool.allocate(4)  # 1 2 3 4
    pool.free([2])
    pool.free([4])
    pool.free([1])
    assert pool.free_block_ids()[:3] == [1, 4, 2]
    assert pool.allocate(3) == [1, 4, 2]


def test_allocate_is_all_or_nothing():
    pool = make_pool(8, 4)
    pool.allocate(6)
    before = pool.stats()
    with pytest.raises(OutOfBlocksError) as info:
        pool.allocate(3)
    assert (info.value.num_requested, info.value.num_free, info.value.num_evictable) == (3, 2, 0)
    assert "requested 3" in str(info.value) and "2 free" in str(info.value)
    assert pool.stats() == before
    pool.check_invariants()


def test_freeing_a_shared_block_twice_in_one_call_releases_it_once():
    pool = make_pool(4, 4)
    (block,) = pool.allocate(1)
    pool.retain([block])
    pool.free([block, block])
    assert pool.free_block_ids().count(block) == 1
    pool.check_invariants()


def test_shared_block_returns_only_when_last_reference_drops():
    pool = make_pool(4, 4)
    (block,) = pool.allocate(1)
    pool.retain([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.ref_count(block) == 1 and pool.num_free_blocks == 3
    pool.free([block])
    assert pool.ref_count(block) == 0 and pool.num_free_blocks == 4


def test_double_free_and_unknown_ids_raise_and_change_nothing():
    pool = make_pool(4, 4)
    pool.allocate(2)
    pool.free([2])
    before = pool.stats()
    with pytest.raises(InvalidBlockError, match="double free"):
        pool.free([2])
    with pytest.raises(InvalidBlockError, match="double free"):
        pool.free([1, 1])  # the second drop would be a double free: nothing is freed
    with pytest.raises(InvalidBlockError, match="does not exist"):
        pool.free([1, 99])
    with pytest.raises(InvalidBlockError, match="does not exist"):
        pool.free([-1])
    with pytest.raises(InvalidBlockError, match="is free"):
        pool.retain([1, 2])
    assert pool.stats() == before and pool.ref_count(1) == 1
    pool.check_invariants()


@pytest.mark.parametrize("bad_id", [True, 1.0, np.int64(1), "1", None])
def test_ids_that_are_not_plain_ints_are_refused_and_free_stays_all_or_nothing(bad_id):
    pool = make_pool(4, 4)
    first, second, third = pool.allocate(3)
    pool.retain([first])  # ref_count 2: a leak or an extra drop would show
    before = pool.stats()
    with pytest.raises(InvalidBlockError):
        pool.free([first, bad_id])  # True once passed as id 1 and freed it while referenced
    with pytest.raises(InvalidBlockError):
        pool.free([first, bad_id, third])  # ... and this one leaked a reference
    with pytest.raises(InvalidBlockError):
        pool.retain([bad_id])
    with pytest.raises(InvalidBlockError):
        pool.ref_count(bad_id)
    assert pool.stats() == before
    assert [pool.ref_count(b) for b in (first, second, third)] == [2, 1, 1]
    pool.check_invariants()


def test_freed_hashed_block_stays_cached_and_can_be_revived():
    pool = make_pool(4, 2)
    (block,) = pool.allocate(1)
    pool.set_num_filled_slots(block, 2)
    block_hash = publish_full_block(pool, block, [7, 8])
    pool.free([block])
    assert pool.evictable_block_ids() == [block] and pool.num_free_blocks == 3
    assert take(pool, [block_hash], [7, 8]) == [block]
    assert pool.ref_count(block) == 1 and pool.num_cached_blocks == 0
    # leaving the cached set counts as an allocation: allocations - frees == used blocks
    assert (pool.stats().num_allocations, pool.stats().num_frees) == (2, 1)
    pool.check_invariants()


def test_cached_blocks_are_evicted_lru_and_only_after_fresh_ones():
    pool = make_pool(4, 2)
    blocks = pool.allocate(3)  # 1 2 3
    for block, tokens in zip(blocks, ([1, 1], [2, 2], [3, 3]), strict=True):
        pool.set_num_filled_slots(block, 2)
        publish_full_block(pool, block, tokens)
    pool.free([3, 1, 2])  # LRU order now 3, 1, 2
    assert pool.evictable_block_ids() == [3, 1, 2]
    assert pool.allocate(1) == [4]  # the fresh block goes first
    assert pool.stats().num_evictions == 0
    assert pool.allocate(2) == [3, 1]  # then least recently used cached blocks
    assert pool.stats().num_evictions == 2
    assert not pool.prefix_cache.is_cached(3) and pool.prefix_cache.is_cached(2)
    pool.check_invariants()


def test_reviving_a_cached_block_moves_it_out_of_lru_order():
    pool = make_pool(3, 1)
    hashes = []
    for block in pool.allocate(3):
        pool.set_num_filled_slots(block, 1)
        hashes.append(publish_full_block(pool, block, [block]))
    pool.free([1, 2, 3])
    take(pool, [hashes[0]], [1])
    pool.free([1])  # 1 becomes most recently used
    assert pool.evictable_block_ids() == [2, 3, 1]


def test_publish_keeps_the_first_block_for_a_hash():
    pool = make_pool(4, 2)
    first, second = pool.allocate(2)
    publish_full_block(pool, first, [5, 6])
    (block_hash,) = hash_full_blocks([5, 6], 2)
    assert not pool.publish(second, block_hash, [5, 6])
    pool.free([first, second])
    assert pool.evictable_block_ids() == [first] and pool.free_block_ids()[0] == second


def test_prefix_caching_off_finds_nothing_and_keeps_nothing():
    pool = make_pool(4, 2, enable_prefix_caching=False)
    (block,) = pool.allocate(1)
    (block_hash,) = hash_full_blocks([1, 2], 2)
    assert not pool.publish(block, block_hash, [1, 2])
    pool.free([block])
    assert pool.num_cached_blocks == 0 and pool.match_prefix([block_hash], [1, 2]).block_ids == []


def test_stats_report_usage_waste_and_counters():
    pool = make_pool(8, 4)
    a, b = pool.allocate(2)
    pool.set_num_filled_slots(a, 4)
    pool.set_num_filled_slots(b, 1)
    stats = pool.stats()
    assert (stats.num_used_blocks, stats.num_free_blocks, stats.num_cached_blocks) == (2, 6, 0)
    assert stats.usage == 0.25
    assert stats.num_unfilled_slots == 3
    pool.free([b, a])
    stats = pool.stats()
    assert (stats.num_allocations, stats.num_frees, stats.num_unfilled_slots) == (2, 2, 0)


def test_prefix_counters_count_tokens_and_blocks():
    pool = make_pool(4, 2)
    (block,) = pool.allocate(1)
    block_hash = publish_full_block(pool, block, [1, 2])
    hashes = hash_full_blocks([1, 2, 3, 4, 5], 2)
    assert hashes[0] == block_hash
    assert take(pool, hashes, [1, 2, 3, 4, 5]) == [block]
    stats = pool.stats()
    assert (stats.prefix_cache_queries_blocks, stats.prefix_cache_hits_blocks) == (2, 1)
    assert (stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens) == (5, 2)


def test_a_match_counts_revivals_and_sizes_admission():
    pool = make_pool(8, 2)
    held, cached = pool.allocate(2)
    hashes = hash_full_blocks([1, 2, 3, 4, 5], 2)
    for block, tokens, block_hash in ((held, [1, 2], hashes[0]), (cached, [3, 4], hashes[1])):
        pool.set_num_filled_slots(block, 2)
        assert pool.publish(block, block_hash, tokens)
    pool.free([cached])
    match = pool.match_prefix(hashes, [1, 2, 3, 4, 5])
    assert (match.block_ids, match.num_cached_tokens, match.num_evictable) == ([held, cached],
                                                                               4, 1)
    # 9 tokens: 5 blocks, 2 of them hits, one of which (cached) must be revived
    assert pool.num_blocks_to_admit(match, 9) == 5 - 2 + 1
    assert pool.stats().prefix_cache_queries_blocks == 0, "matching alone counts nothing"


def test_a_generation_moves_with_each_hand_out_and_never_on_a_revival_or_retain():
    pool = make_pool(2, 2)
    assert [pool.generation(b) for b in (NULL_BLOCK_ID, 1, 2)] == [0, 0, 0]
    first, second = pool.allocate(2)  # the batch path
    assert (pool.generation(first), pool.generation(second)) == (1, 1)
    block_hash = publish_full_block(pool, first, [1, 2])
    pool.retain([first])  # another holder: same content
    pool.free([first])
    pool.free([first])  # cached
    assert take(pool, [block_hash], [1, 2]) == [first]  # revived by a prefix hit
    assert pool.generation(first) == 1
    pool.free([second])
    assert pool.allocate(1) == [second]  # the one-block hot path, from the free list
    assert pool.generation(second) == 2
    pool.free([first])
    pool.free([second])
    assert sorted(pool.allocate(2)) == [first, second]  # first evicted from the cache
    assert (pool.generation(first), pool.generation(second)) == (2, 3)
    pool.check_invariants()


def test_a_reset_keeps_generations_and_generation_refuses_ids_outside_the_pool():
    pool = make_pool(2, 2)
    pool.free(pool.allocate(2))
    pool.reset()
    assert [pool.generation(b) for b in (1, 2)] == [1, 1]
    assert pool.allocate(1) == [1] and pool.generation(1) == 2
    for bad_id in (-1, 3, 1.0, True):
        with pytest.raises(InvalidBlockError, match="capacity"):
            pool.generation(bad_id)


@pytest.mark.parametrize(("num_blocks", "block_size"), [(0, 4), (4, 0)])
def test_invalid_pool_shapes_are_rejected(num_blocks, block_size):
    with pytest.raises(ValueError, match="at least 1"):
        make_pool(num_blocks, block_size)


def test_a_view_of_a_new_pool_has_no_hashes_and_one_free_run():
    from kvpool.memory.pool_view import take_pool_view

    view = take_pool_view(BlockPool(8, KVLayout(4)), [])
    assert len(view.hashes) == 0 and view.to_json()["hashes"] == []
    assert [(run.state, run.count) for run in view.runs] == [("offline", 1), ("free", 8)]

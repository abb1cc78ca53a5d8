"""SequenceBlocks: logical → physical mapping, slots, fork, copy-on-write, prefix reuse, free.

Id 0 is the null block, so the pool hands out 1, 2, 3, ...
"""

from __future__ import annotations

import pytest

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.block_table import BlockCopy, BlockTable
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import hash_full_blocks
from kvpool.memory.sequence_blocks import SequenceBlocks


@pytest.fixture
def pool() -> BlockPool:
    return BlockPool(8, KVLayout(block_size=4))


def test_append_allocates_a_block_only_when_the_last_is_full(pool):
    table = SequenceBlocks(pool)
    table.append_tokens([10, 11, 12])
    assert table.block_ids == [1]
    table.append_tokens([13])
    assert table.block_ids == [1]
    table.append_tokens([14])
    assert table.block_ids == [1, 2]
    assert table.num_tokens == 5 and table.token_ids == [10, 11, 12, 13, 14]


def test_slots_follow_the_block_table(pool):
    pool.allocate(2)  # blocks 1 and 2 are taken, so the table gets 3, 4, ...
    table = SequenceBlocks(pool)
    table.append_tokens(list(range(6)))
    assert table.block_ids == [3, 4]
    layout = pool.layout
    assert [layout.slot(table.block_ids, p) for p in range(6)] == [12, 13, 14, 15, 16, 17]
    assert layout.slot_mapping(table.block_ids, 3, 6) == [15, 16, 17]


def test_fork_shares_every_block_without_copying(pool):
    parent = SequenceBlocks(pool)
    parent.append_tokens(list(range(6)))
    child = parent.fork()
    assert child.block_ids == parent.block_ids == [1, 2]
    assert [pool.ref_count(b) for b in (1, 2)] == [2, 2]
    assert pool.num_used_blocks == 2


def test_writing_into_a_shared_partial_block_copies_it_first(pool):
    parent = SequenceBlocks(pool)
    parent.append_tokens(list(range(6)))  # block 2 holds 2 of 4 slots
    child = parent.fork()
    copies = child.append_tokens([100])
    assert copies == [BlockCopy(src_block_id=2, dst_block_id=3)]
    assert child.block_ids == [1, 3] and parent.block_ids == [1, 2]
    assert [pool.ref_count(b) for b in (1, 2, 3)] == [2, 1, 1]
    # the parent's last block is now private again: no second copy
    assert parent.append_tokens([200]) == []
    assert parent.block_ids == [1, 2]
    pool.check_invariants()


def test_a_shared_full_last_block_needs_no_copy(pool):
    parent = SequenceBlocks(pool)
    parent.append_tokens(list(range(4)))
    child = parent.fork()
    assert child.num_blocks_to_append(1) == 1
    assert child.append_tokens([9]) == []
    assert child.block_ids == [1, 2] and parent.block_ids == [1]


def test_append_is_all_or_nothing_on_exhaustion(pool):
    table = SequenceBlocks(pool)
    table.append_tokens(list(range(6)))
    child = table.fork()
    pool.allocate(pool.num_allocatable_blocks - 1)  # one block left; COW + 1 new block needs 2
    assert child.num_blocks_to_append(3) == 2
    with pytest.raises(OutOfBlocksError):
        child.append_tokens([1, 2, 3])
    assert child.block_ids == [1, 2] and child.num_tokens == 6
    assert pool.ref_count(2) == 2
    pool.check_invariants()


def test_free_returns_every_block_and_hashed_blocks_stay_cached(pool):
    table = SequenceBlocks(pool)
    table.append_tokens(list(range(10)))  # two full blocks (hashed) and one partial
    table.free()
    assert table.block_ids == [] and table.num_tokens == 0
    assert pool.num_used_blocks == 0
    assert pool.num_cached_blocks == 2
    # freed tail first, so the tail full block is the first to be evicted
    assert pool.evictable_block_ids() == [2, 1]
    assert pool.free_block_ids()[0] == 3


def test_a_new_table_reuses_the_longest_cached_prefix(pool):
    first = SequenceBlocks(pool)
    first.append_tokens(list(range(10)))
    second = SequenceBlocks(pool)
    assert second.take_cached_prefix([*list(range(9)), 99]) == 8
    assert second.block_ids == [1, 2]
    assert [pool.ref_count(b) for b in (1, 2)] == [2, 2]
    second.append_tokens([8, 99])
    assert second.block_ids == [1, 2, 4]
    third = SequenceBlocks(pool)
    assert third.take_cached_prefix([0, 1, 2, 3, 0, 0, 0, 0]) == 4  # diverges in block 1
    pool.check_invariants()


def test_a_planned_match_is_taken_with_the_callers_hashes(pool):
    first = SequenceBlocks(pool)
    first.append_tokens(list(range(10)))
    tokens = list(range(9))
    hashes = hash_full_blocks(tokens, 4)
    match = pool.match_prefix(hashes, tokens)
    table = SequenceBlocks(pool)
    assert table.take_prefix(match, tokens, hashes) == 8
    assert table.block_ids == [1, 2] and table.block_hashes == hashes[:2]
    table.append_tokens([8, 9, 10, 11], computed=False)
    assert table.block_hashes == hash_full_blocks(list(range(12)), 4)
    table.mark_computed(12)
    assert table.num_published_blocks == 3
    pool.check_invariants()


def test_a_table_keeps_counts_and_publishes_its_owners_tokens_and_hashes(pool):
    """The engine's way: the sequence owns tokens and hashes; the table only counts."""
    SequenceBlocks(pool).append_tokens(list(range(10)))
    tokens = list(range(12))
    hashes = hash_full_blocks(tokens, 4)
    table = BlockTable(pool)
    assert table.take_prefix(pool.match_prefix(hashes, tokens[:9])) == 8
    assert (table.block_ids, table.num_tokens, table.num_published_blocks) == ([1, 2], 8, 2)
    assert table.append_slots(4) == []
    assert table.num_published_blocks == 2  # not computed yet
    table.mark_computed(12, lambda start, end: tokens[start:end], hashes)
    assert table.num_published_blocks == 3
    assert pool.prefix_cache.lookup(hashes[2], tokens[8:12]) == table.block_ids[2]
    child = table.fork()
    assert (child.block_ids, child.num_tokens) == (table.block_ids, 12)
    child.free()
    table.free()
    assert (table.block_ids, table.num_tokens, table.num_published_blocks) == ([], 0, 0)
    pool.check_invariants()


def test_different_salts_never_share(pool):
    salted = SequenceBlocks(pool, cache_salt="a")
    salted.append_tokens(list(range(8)))
    assert SequenceBlocks(pool, cache_salt="b").take_cached_prefix(list(range(8))) == 0
    assert SequenceBlocks(pool).take_cached_prefix(list(range(8))) == 0
    assert SequenceBlocks(pool, cache_salt="a").take_cached_prefix(list(range(8))) == 8


def test_uncomputed_blocks_are_not_offered_until_marked(pool):
    table = SequenceBlocks(pool)
    table.append_tokens(list(range(8)), computed=False)
    assert SequenceBlocks(pool).take_cached_prefix(list(range(8))) == 0
    table.mark_computed(5)  # only block 0 is fully computed
    assert table.num_published_blocks == 1
    assert SequenceBlocks(pool).take_cached_prefix(list(range(8))) == 4


def test_unfilled_slots_track_the_partial_last_block(pool):
    table = SequenceBlocks(pool)
    table.append_tokens([1, 2, 3, 4, 5])
    assert pool.stats().num_unfilled_slots == 3
    table.append_tokens([6, 7])
    assert pool.stats().num_unfilled_slots == 1

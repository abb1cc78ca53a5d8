"""The hybrid pool: groups of different page sizes in one arena, sliding tables that drop what
left their window, and prefix hits every group can serve."""

from __future__ import annotations

import pytest

from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.sequence_blocks import SequenceBlocks
from tests.memory.hybrid_checks import (
    BLOCK_SIZE,
    assert_window_bound,
    gemma_like_groups,
    hybrid_pool,
)


def test_groups_take_pages_of_their_own_size_from_one_arena():
    groups = gemma_like_groups()  # 2 full layers, 4 sliding: pages of 2 and 4 layer-blocks
    pool = hybrid_pool(groups, num_pages_of_largest=8)
    layer_block = BLOCK_SIZE * 2 * 8 * 4  # tokens * (K, V) * head_dim * float32
    assert pool.page_bytes == (2 * layer_block, 4 * layer_block)
    assert pool.unit == 2 * layer_block  # the gcd: ids are offsets in units of it
    seq = SequenceBlocks(pool)
    seq.append_tokens(list(range(10)))  # 3 blocks in each group
    full, sliding = seq.table.tables
    assert len(full.block_ids) == len(sliding.block_ids) == 3
    assert pool.num_used_bytes() == 3 * 2 * layer_block + 3 * 4 * layer_block
    pool.check_invariants()


def test_a_long_generation_holds_the_window_bound_at_every_step():
    groups = gemma_like_groups(window=32)
    pool = hybrid_pool(groups, num_pages_of_largest=600)
    seq = SequenceBlocks(pool)
    seq.append_tokens(list(range(40)))
    for token in range(2000):
        seq.append_tokens([token])
        assert_window_bound(seq)
    full, sliding = seq.table.tables
    assert len(full.live_block_ids) == 510 and len(sliding.live_block_ids) <= 9
    assert sliding.block_ids[: sliding.num_dropped_blocks] == [NULL_BLOCK_ID] * (
        sliding.num_dropped_blocks)
    pool.check_invariants()
    seq.free()
    assert all(p.num_used_blocks == 0 for p in pool.pools)
    pool.check_invariants()


def test_dropped_blocks_stay_cached_and_a_repeat_prompt_hits_in_every_group():
    groups = gemma_like_groups(window=8)
    pool = hybrid_pool(groups, num_pages_of_largest=40)
    prompt = list(range(100, 141))  # 41 tokens: 10 full blocks
    first = SequenceBlocks(pool)
    first.append_tokens(prompt[:20])
    first.append_tokens(prompt[20:])
    assert first.table.tables[1].num_dropped_blocks > 0
    first.free()
    second = SequenceBlocks(pool)
    assert second.take_cached_prefix(prompt) == 40
    full, sliding = second.table.tables
    assert NULL_BLOCK_ID not in full.block_ids
    # The next query is at 40, which reads 33..40: blocks 8 and 9 of the window group only.
    assert sliding.num_dropped_blocks == 8 and len(sliding.live_block_ids) == 2
    pool.check_invariants()


def cached_prompt():
    """A pool (window 8) holding a 41-token prompt's 10 full blocks cached in both groups."""
    pool = hybrid_pool(gemma_like_groups(window=8), num_pages_of_largest=40)
    prompt = list(range(100, 141))
    first = SequenceBlocks(pool)
    first.append_tokens(prompt)
    hashes = list(first.block_hashes)
    first.free()
    return pool, prompt, hashes


def test_a_hit_stops_where_a_sliding_group_lost_the_window():
    pool, prompt, hashes = cached_prompt()
    sliding_pool = pool.pools[1]
    last = sliding_pool.prefix_cache.lookup(hashes[9], prompt[36:40])
    sliding_pool.remove_blocks([last])  # the window group lost block 9 (evicted)
    match = pool.match_prefix(hashes, prompt)
    # 40 tokens would need block 9 of the window group; 36 need blocks 7 and 8, still cached.
    assert match.num_cached_tokens == 36
    assert [m.num_cached_tokens for m in match.matches] == [36, 36]


def test_a_full_group_miss_cuts_the_hit_for_every_group():
    pool, prompt, hashes = cached_prompt()
    full_pool = pool.pools[0]
    third = full_pool.prefix_cache.lookup(hashes[2], prompt[8:12])
    full_pool.remove_blocks([third])
    assert pool.match_prefix(hashes, prompt).num_cached_tokens == 8


def test_memory_moves_to_the_group_that_needs_it():
    groups = gemma_like_groups(window=8)
    pool = hybrid_pool(groups, num_pages_of_largest=6)  # 12 full pages or 6 sliding ones
    full_pool, sliding_pool = pool.pools
    assert pool.make_allocatable([12, 0]) and full_pool.num_blocks == 12
    assert pool.make_allocatable([0, 6])  # the full group's free pages go back to the arena
    assert (full_pool.num_blocks, sliding_pool.num_blocks) == (0, 6)
    pool.check_invariants()
    seq = SequenceBlocks(pool)
    seq.append_tokens([9] * 8)  # 2 pages per group: room for 6 full pages is left
    assert not pool.make_allocatable([7, 0])
    assert pool.make_allocatable([6, 0])  # what the sliding group's free pages gave back
    seq.free()  # its full blocks are cached now
    assert full_pool.num_cached_blocks == 2 and sliding_pool.num_cached_blocks == 2
    assert pool.make_allocatable([0, 6])  # cached pages of the other group are evicted
    assert full_pool.num_cached_blocks == 0 and full_pool.num_blocks == 0
    pool.check_invariants()


def test_append_is_all_or_nothing_across_groups():
    groups = gemma_like_groups(window=8)
    pool = hybrid_pool(groups, num_pages_of_largest=3)
    seq = SequenceBlocks(pool)
    seq.append_tokens(list(range(8)))  # 2 full pages + 2 sliding ones = 3 sliding: all
    with pytest.raises(OutOfBlocksError):
        seq.append_tokens([9])
    assert [t.num_tokens for t in seq.table.tables] == [8, 8]
    pool.check_invariants()


def test_fork_shares_live_blocks_and_copies_the_partial_one_per_group():
    groups = gemma_like_groups(window=8)
    pool = hybrid_pool(groups, num_pages_of_largest=40)
    parent = SequenceBlocks(pool)
    parent.append_tokens(list(range(30)))
    child = parent.fork()
    copies = child.append_tokens([7])
    assert sorted(copy.group for copy in copies) == [0, 1]
    for parent_table, table in zip(parent.table.tables, child.table.tables, strict=True):
        for block_id in table.live_block_ids[:-1]:
            assert table.pool.ref_count(block_id) == 2
        # The child's window moved on: what it dropped the parent alone holds now.
        for block_id in parent_table.block_ids[: table.num_dropped_blocks]:
            assert table.pool.ref_count(block_id) == 1
    assert child.table.tables[1].num_dropped_blocks == 5  # query at 30 reads 23..30
    parent.free()
    child.free()
    assert all(p.num_used_blocks == 0 for p in pool.pools)
    pool.check_invariants()


def test_padding_every_page_to_the_largest_costs_what_size_classes_save():
    """Gemma-4-like: sliding layers with head_dim 8, full ones with 16."""
    from kvpool.memory.kv_groups import KVGroup
    from kvpool.memory.kv_layout import KVLayout

    sliding = KVGroup((0, 1, 2, 3), 8, KVLayout(BLOCK_SIZE, 4, 1, 8, "float32"))
    full = KVGroup((4, 5), None, KVLayout(BLOCK_SIZE, 2, 1, 16, "float32"))
    pool = hybrid_pool((full, sliding), num_pages_of_largest=20)
    assert pool.page_bytes[0] == pool.page_bytes[1]  # 2 layers * 16 == 4 layers * 8
    seq = SequenceBlocks(pool)
    seq.append_tokens(list(range(40)))
    pool.check_invariants()

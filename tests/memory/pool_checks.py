"""Checks the memory property tests share (imported by test modules of this folder)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from kvpool.formats.kv_snapshot import CACHED, FREE, OFFLINE, USED, PoolView
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.prefix_cache import hash_full_blocks
from kvpool.memory.sequence_blocks import SequenceBlocks


def assert_cached_blocks_hold_table_tokens(pool: BlockPool,
                                           tables: Iterable[SequenceBlocks]) -> None:
    """Every cached block a table holds is found under the hash of that table's own tokens
    and salt: the prefix cache never maps a table's prefix to a block of other tokens."""
    size = pool.block_size
    for table in tables:
        hashes = hash_full_blocks(table.token_ids, size, table.salt)
        for index, block_id in enumerate(table.block_ids[: len(hashes)]):
            if pool.prefix_cache.is_cached(block_id):
                tokens = table.token_ids[index * size : (index + 1) * size]
                assert pool.prefix_cache.lookup(hashes[index], tokens) == block_id


def assert_view_matches_pool(view: PoolView, pool: BlockPool,
                             tables: list[tuple[int, ...]]) -> None:
    """A `PoolView` of `pool` (taken with `tables`, sequence i holding `tables[i]`) says what
    the pool says: runs cover every id once, state counts equal `stats()`, a used block's
    ref_count is its number of holders plus its leases and each holder's table lists it, only
    used blocks have leases, hashes and the LRU order are the pool's."""
    assert [run.first_id for run in view.runs] == sorted(run.first_id for run in view.runs)
    covered = [block_id for run in view.runs for block_id in run.block_ids]
    assert covered == list(range(pool.capacity_blocks)), "runs must cover every id once"
    stats = pool.stats()
    assert view.count(USED) == stats.num_used_blocks
    assert view.count(FREE) == stats.num_free_blocks
    assert view.count(CACHED) == stats.num_cached_blocks
    assert view.count(OFFLINE) == pool.capacity_blocks - pool.num_blocks
    holders_of: dict[int, list[int]] = {}
    for index, table in enumerate(tables):
        for block_id in table:
            holders_of.setdefault(block_id, []).append(index)
    for info in view.blocks():
        assert info.ref_count == pool._ref_counts[info.block_id]
        if info.state == USED:
            assert info.ref_count == len(info.holders) + info.num_leases, f"block {info.block_id}"
            assert sorted(info.holders) == sorted(holders_of.get(info.block_id, []))
        else:
            assert info.holders == () and info.block_id not in holders_of
            assert info.num_leases == 0, f"block {info.block_id}"
        assert (info.short_hash is not None) == pool.prefix_cache.is_cached(info.block_id)
        assert (info.age_s is None) == (info.state == OFFLINE or math.isnan(
            pool._last_use[info.block_id]))
    assert list(view.lru) == pool.evictable_block_ids()


def generations(pool: BlockPool) -> list[int]:
    """Every id's generation, the null block's and the offline ones' included."""
    return [pool.generation(block_id) for block_id in range(pool.capacity_blocks)]


def assert_generations_moved_exactly(before: list[int], after: list[int],
                                     moved: set[int]) -> None:
    """Between two looks at a pool's generations, an id's changed iff it is in `moved` (the
    ids that stopped naming their KV meanwhile), and none went down."""
    for block_id, (old, new) in enumerate(zip(before, after, strict=True)):
        assert new >= old, f"block {block_id}'s generation went down: {old} -> {new}"
        assert (new != old) == (block_id in moved), (
            f"block {block_id}: generation {old} -> {new}, but moved is {block_id in moved}")

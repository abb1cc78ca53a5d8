"""Checks the memory property tests share (imported by test modules of this folder)."""

from __future__ import annotations

from collections.abc import Iterable

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.block_table import BlockTable
from kvpool.memory.prefix_cache import hash_full_blocks


def assert_cached_blocks_hold_table_tokens(pool: BlockPool, tables: Iterable[BlockTable]) -> None:
    """Every cached block a table holds is found under the hash of that table's own tokens
    and salt: the prefix cache never maps a table's prefix to a block of other tokens."""
    size = pool.block_size
    for table in tables:
        hashes = hash_full_blocks(table.token_ids, size, table.salt)
        for index, block_id in enumerate(table.block_ids[: len(hashes)]):
            if pool.prefix_cache.is_cached(block_id):
                tokens = table.token_ids[index * size : (index + 1) * size]
                assert pool.prefix_cache.lookup(hashes[index], tokens) == block_id

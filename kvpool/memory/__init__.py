"""The memory core: block pool, block tables, prefix cache (pure Python), and KV tensors."""

from kvpool.memory.block_pool import (
    BlockPool,
    BlockPoolStats,
    InvalidBlockError,
    OutOfBlocksError,
)
from kvpool.memory.block_table import BlockCopy, BlockTable
from kvpool.memory.prefix_cache import NullPrefixCache, PrefixCache, hash_block, hash_full_blocks

__all__ = [
    "BlockCopy",
    "BlockPool",
    "BlockPoolStats",
    "BlockTable",
    "InvalidBlockError",
    "NullPrefixCache",
    "OutOfBlocksError",
    "PrefixCache",
    "hash_block",
    "hash_full_blocks",
]

"""The memory core: KV layout, block pool, block tables, prefix cache (pure Python), KV tensors
and the KV-memory façade the engine holds."""

from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool, BlockPoolStats
from kvpool.memory.block_table import BlockCopy, BlockTable
from kvpool.memory.errors import InvalidBlockError, OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import (
    NullPrefixCache,
    PrefixCache,
    PrefixMatch,
    hash_block,
    hash_full_blocks,
    salt_key,
)
from kvpool.memory.sequence_blocks import SequenceBlocks

__all__ = [
    "NULL_BLOCK_ID",
    "BlockCopy",
    "BlockPool",
    "BlockPoolStats",
    "BlockTable",
    "InvalidBlockError",
    "KVLayout",
    "NullPrefixCache",
    "OutOfBlocksError",
    "PrefixCache",
    "PrefixMatch",
    "SequenceBlocks",
    "hash_block",
    "hash_full_blocks",
    "salt_key",
]

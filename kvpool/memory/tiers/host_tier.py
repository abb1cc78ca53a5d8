"""The host tier: a second block pool, in host memory, one level below the device pool.

    HostKVTier
      pool      BlockPool of host block ids: its own free list, reference counts and LRU
                prefix cache, the same invariants as the device pool's
      kv_cache  KVCache on the CPU in the device's layout (int8 / fp8 scales included),
                page-locked when the device is CUDA, so copies to and from it are asynchronous

A host block holds one of two kinds of KV:

    swapped   used   (ref_count >= 1, unhashed): a preempted sequence's blocks until it resumes
    spilled   cached (ref_count 0, hashed): a prefix block the device pool evicted; evicted in
              turn, least recently used first (to the disk tier, when there is one)

A host block that a queued copy reads or writes holds one more reference until the copy is done
(`kvpool.memory.tiers.kv_transfer`), so neither the LRU nor a new owner can touch it mid-copy.

Invariants (`check_invariants`): the block pool's; the tensors have the layout's shape and dtype
with one row per id (the null block included) and stay on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.memory.block_pool import HOST, BlockPool
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.tiers.lower_tier import BlockFinder, LowerTier


@dataclass(frozen=True, slots=True)
class HostTierStats:
    """A snapshot of the host tier, in blocks unless a name says otherwise."""

    num_blocks: int
    num_free_blocks: int
    num_used_blocks: int  # swapped-out sequences' blocks and blocks mid-copy
    num_cached_blocks: int  # spilled prefix blocks
    num_bytes: int  # host memory held by the tier
    is_pinned: bool


class HostKVTier(LowerTier):
    """`num_blocks` host KV blocks of `layout`, allocated once (pinned with `pin_memory`)."""

    name = HOST

    def __init__(self, layout: KVLayout, num_blocks: int, pin_memory: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"the host tier needs at least one block, got {num_blocks}")
        self.layout = layout
        self.pool = BlockPool(num_blocks, layout, enable_prefix_caching=True, medium=HOST)
        self.kv_cache = KVCache(layout, num_blocks + 1, "cpu", pin_memory=pin_memory)
        self.is_pinned = pin_memory

    @classmethod
    def for_budget(cls, layout: KVLayout, num_bytes: int,
                   pin_memory: bool = False) -> HostKVTier | None:
        """The tier `num_bytes` of host memory holds (the null block paid for too), or None
        when that is not even one block."""
        if num_bytes < 2 * layout.bytes_per_block:
            return None
        return cls(layout, layout.num_blocks_for_memory(num_bytes) - 1, pin_memory)

    def start_lookup(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> BlockFinder:
        """Each block looked up in the host's prefix cache (token ids compared)."""
        lookup = self.pool.prefix_cache.lookup
        return lambda index, token_ids: lookup(block_hashes[index], token_ids)

    def holds(self, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        return self.pool.prefix_cache.lookup(block_hash, token_ids) is not None

    def reset(self) -> None:
        """With no block used: spilled prefixes dropped, counters zero."""
        self.pool.reset()

    def stats(self) -> HostTierStats:
        pool = self.pool
        return HostTierStats(pool.num_blocks, pool.num_free_blocks, pool.num_used_blocks,
                             pool.num_cached_blocks, self.kv_cache.nbytes, self.is_pinned)

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (for tests)."""
        self.pool.check_invariants()
        self.layout.check_tensor(self.kv_cache.tensor)
        self.layout.check_scales(self.kv_cache.scales, self.kv_cache.num_blocks)
        assert self.kv_cache.num_blocks == self.pool.capacity_blocks
        assert self.kv_cache.tensor.device == torch.device("cpu")

"""What the tiers below a block pool hear of its prefix cache (`BlockPool.tier_hooks`): every
block published, and every cached block evicted to make room for an allocation, while its KV
is still intact. `NO_TIER_HOOKS`, a pool's default, hears nothing; `KVTiers` spills and writes
through (`kvpool.memory.kv_tiers`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpool.memory.prefix_cache import BlockHash, CachedBlock


class TierHooks(Protocol):
    """What the tiers below a pool hear of its prefix cache."""

    def published(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """A used block's KV was computed and entered the prefix cache."""
        ...

    def evicted(self, block_id: int, entry: CachedBlock) -> None:
        """A cached block is being reused: its KV is intact until the next step's copies."""
        ...


class _NoTierHooks:
    def published(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        return None

    def evicted(self, block_id: int, entry: CachedBlock) -> None:
        return None


NO_TIER_HOOKS: TierHooks = _NoTierHooks()

"""The tiers below the device pool: host memory, disk files and a shared Redis, one ordered list
behind one interface (`lower_tier.LowerTier`), coordinated by `KVTiers` (spill, write-through,
reload, swap) with the copies between them (`kv_transfer`) and the prefix walk (`tier_match`).

The pure core (block pool, block table, prefix cache, layout, KV tensors) imports nothing from
here; the tiers hear the device pool as a KV listener (`kvpool.memory.kv_listener`).
"""

from kvpool.memory.tiers.disk_tier import DiskKVTier, DiskTierStats
from kvpool.memory.tiers.host_tier import HostKVTier, HostTierStats
from kvpool.memory.tiers.kv_tiers import TIERS, KVTiers, KVTierStats
from kvpool.memory.tiers.lower_tier import DISK, HOST, SHARED, LowerTier, StoredRef
from kvpool.memory.tiers.redis_tier import RedisKVTier, SharedTierStats
from kvpool.memory.tiers.tier_match import LoadedBlock, TierLookup, TierMatch

__all__ = [
    "DISK",
    "HOST",
    "SHARED",
    "TIERS",
    "DiskKVTier",
    "DiskTierStats",
    "HostKVTier",
    "HostTierStats",
    "KVTierStats",
    "KVTiers",
    "LoadedBlock",
    "LowerTier",
    "RedisKVTier",
    "SharedTierStats",
    "StoredRef",
    "TierLookup",
    "TierMatch",
]

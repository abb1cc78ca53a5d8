"""The write-through after a step (`KVTiers.after_step`): a block goes out under the hash it
was published with only while the device pool still caches it under that hash, and a step
that failed (`step_rolled_back`) writes nothing. A block freed and reused by another request
holds that request's KV: written under the first hash, it would serve the wrong KV forever.
The engine-level repro is tests/engine/test_kv_tiers.py."""

from __future__ import annotations

import torch

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.tiers.lower_tier import DISK, LowerTier

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
HASH_A, HASH_B = b"a" * 32, b"b" * 32
TOKENS_A, TOKENS_B = [1, 2, 3, 4], [5, 6, 7, 8]


class RecordingTier(LowerTier):
    """A written-through tier that wants every block and keeps what it is handed."""

    name = DISK

    def __init__(self) -> None:
        self.stored: dict[bytes, torch.Tensor] = {}

    def start_lookup(self, block_hashes, num_blocks):
        return lambda index, token_ids: None

    def wanted(self, block_hashes):
        return set(block_hashes) - self.stored.keys()

    def store(self, block_hash, token_ids, kv, scales, ready=None):
        self.stored[block_hash] = kv.clone()

    def stats(self):
        return {}

    def check_invariants(self):
        pass


def memory_with_tier() -> tuple[KVMemory, RecordingTier]:
    tier = RecordingTier()
    return KVMemory(LAYOUT, 1, disk=tier), tier  # one block: every allocation reuses it


def publish_a(memory: KVMemory) -> int:
    """Tenant A's block: computed (KV 1.0) and published, then its request frees it."""
    [block_id] = memory.pool.allocate(1)
    memory.kv_cache.tensor[block_id] = 1.0
    memory.pool.publish(block_id, HASH_A, TOKENS_A)
    memory.pool.free([block_id])
    return block_id


def test_a_block_reused_before_the_write_is_not_written_under_its_old_hash():
    memory, tier = memory_with_tier()
    block_id = publish_a(memory)
    [reused] = memory.pool.allocate(1)  # tenant B evicts A's block and computes into it
    assert reused == block_id
    memory.kv_cache.tensor[reused] = 2.0
    memory.tiers.after_step()
    assert tier.stored == {}
    memory.pool.publish(reused, HASH_B, TOKENS_B)  # B's block, published under B's hash
    memory.tiers.after_step()
    assert list(tier.stored) == [HASH_B] and (tier.stored[HASH_B] == 2.0).all()
    memory.pool.free([reused])


def test_a_block_still_cached_under_its_hash_is_written():
    memory, tier = memory_with_tier()
    publish_a(memory)
    memory.tiers.after_step()
    assert list(tier.stored) == [HASH_A] and (tier.stored[HASH_A] == 1.0).all()


def test_a_rolled_back_step_writes_nothing_it_published():
    memory, tier = memory_with_tier()
    publish_a(memory)
    memory.listeners.step_rolled_back()
    memory.listeners.step_ended(1)
    assert tier.stored == {}

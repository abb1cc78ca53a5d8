"""Block copies between the device pool and the host tier: the order that keeps reads ahead of
clobbering writes, held host blocks released once copied, and (on CUDA) the same results from
the side stream with events, the compute stream waiting only when it must."""

from __future__ import annotations

import pytest
import torch

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory
from tests.memory.arena_checks import DEVICES

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def memory_on(device: str, layout: KVLayout = LAYOUT) -> KVMemory:
    return KVMemory(layout, 8, device, host_num_bytes=9 * layout.bytes_per_block)


def fill(memory: KVMemory, block_id: int, value: float) -> None:
    memory.kv_cache.tensor[block_id] = value
    if memory.kv_cache.scales is not None:
        memory.kv_cache.scales[block_id] = value + 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_evicted_and_reused_in_one_step_is_copied_out_before_it_is_overwritten(device):
    """Device block 1 is spilled to host block 1 and, in the same step, receives host block 2
    (a swap-in): out first, then in; the held host blocks are released after."""
    memory = memory_on(device)
    tiers, host = memory.tiers, memory.tiers.host
    fill(memory, 1, 7.0)
    [swapped] = host.pool.allocate(1)
    host.kv_cache.tensor[swapped] = 3.0
    [spill_to] = host.pool.allocate(1)
    tiers.transfers.device_to_host([1], [spill_to], hold=True)  # the queue's reference...
    tiers.swap_in([swapped], [1])  # ...and this one pass to the queue too
    assert tiers.transfers.num_held_host_blocks == 2
    tiers.before_step()
    tiers.transfers.synchronize()
    assert (host.kv_cache.tensor[spill_to] == 7.0).all()
    assert (memory.kv_cache.tensor[1] == 3.0).all()
    assert host.pool.num_used_blocks == 0 and tiers.transfers.num_held_host_blocks == 0
    host.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_swap_out_and_back_moves_codes_and_scales(device):
    memory = memory_on(device, KVLayout(4, 2, 2, 8, "int8"))
    tiers = memory.tiers
    for block_id in (1, 2, 3):
        fill(memory, block_id, float(block_id))
    host_ids = tiers.swap_out([1, 2, 3])
    tiers.before_step()
    for block_id in (1, 2, 3):
        fill(memory, block_id, 0.0)  # the device blocks are reused meanwhile
    tiers.swap_in(host_ids, [3, 2, 1])
    tiers.before_step()
    tiers.transfers.synchronize()
    for source, destination in zip((1, 2, 3), (3, 2, 1), strict=True):
        assert (memory.kv_cache.tensor[destination] == source).all()
        assert (memory.kv_cache.scales[destination] == source + 0.5).all()
    assert memory.tiers.host.pool.num_used_blocks == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_is_the_blocks_as_computed(device):
    memory = memory_on(device)
    fill(memory, 4, 5.0)
    snapshot = memory.tiers.transfers.snapshot([4])
    memory.tiers.before_step(lambda: {4})  # the next step writes block 4...
    fill(memory, 4, 6.0)  # ...after the snapshot's copy (CUDA: the compute stream waits)
    if snapshot.ready is not None:
        snapshot.ready.synchronize()
    assert snapshot.kv.device == torch.device("cpu") and (snapshot.kv == 5.0).all()


def test_a_host_tier_smaller_than_two_blocks_is_none():
    assert memory_on("cpu").tiers.host.pool.num_blocks == 8
    assert KVMemory(LAYOUT, 8, host_num_bytes=LAYOUT.bytes_per_block).tiers.host is None
    assert not KVMemory(LAYOUT, 8).tiers.has_host

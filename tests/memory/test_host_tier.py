"""The host tier on its own: sized from a byte budget like the device pool (the null block
paid for), its tensors in the device's layout on the CPU, its stats, and a reset."""

from __future__ import annotations

import pytest

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.tiers.host_tier import HostKVTier

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_budget_buys_blocks_of_the_device_layout(dtype):
    layout = KVLayout(4, 2, 2, 8, dtype)
    host = HostKVTier.for_budget(layout, 11 * layout.bytes_per_block)
    assert host.pool.num_blocks == 10  # one row is the null block
    assert host.kv_cache.tensor.shape == layout.tensor_shape(11)
    assert (host.kv_cache.scales is not None) == layout.is_quantized
    assert host.stats().num_bytes == 11 * layout.bytes_per_block
    assert not host.is_pinned  # page-locked only beside a CUDA device
    host.check_invariants()


def test_less_than_two_blocks_is_no_tier():
    assert HostKVTier.for_budget(LAYOUT, 2 * LAYOUT.bytes_per_block - 1) is None
    with pytest.raises(ValueError, match="at least one block"):
        HostKVTier(LAYOUT, 0)


def test_stats_count_swapped_and_spilled_blocks_and_reset_drops_the_spilled():
    host = HostKVTier(LAYOUT, 4)
    swapped = host.pool.allocate(2)
    [spilled] = host.pool.allocate(1)
    host.pool.publish(spilled, bytes(32), [1, 2, 3, 4])
    host.pool.free([spilled])
    stats = host.stats()
    assert (stats.num_used_blocks, stats.num_cached_blocks, stats.num_free_blocks) == (2, 1, 1)
    host.pool.free(swapped)
    host.reset()
    assert host.stats().num_free_blocks == 4 and host.stats().num_cached_blocks == 0
    host.check_invariants()

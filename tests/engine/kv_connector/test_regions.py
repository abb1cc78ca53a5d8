"""KV regions: a plain cache's tensors as regions, and the byte ranges that move blocks
between two engines' regions (consecutive runs merged, every id range-checked)."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.kv_connector.regions import (
    KVRegion,
    block_ranges,
    kv_tensors,
    region_block_bytes,
    regions_of,
)
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")
LOCAL = (KVRegion(1_000_000, 10 * 128, 128),)
REMOTE = (KVRegion(5_000_000, 6 * 128, 128),)


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_plain_cache_is_one_region_per_tensor(dtype: str) -> None:
    layout = KVLayout(block_size=4, num_layers=2, num_kv_heads=1, head_dim=4, dtype=dtype)
    cache = KVCache(layout, num_blocks=5)

    regions = regions_of(kv_tensors(cache))

    assert [r.bytes_per_block for r in regions] == list(region_block_bytes(layout))
    assert sum(r.bytes_per_block for r in regions) == layout.bytes_per_block
    assert regions[0] == KVRegion(cache.tensor.data_ptr(), 5 * layout.kv_bytes_per_block,
                                  layout.kv_bytes_per_block)
    assert regions[0].block_address(3) == cache.tensor[3].data_ptr()


def test_a_strided_tensor_is_not_a_region() -> None:
    with pytest.raises(ValueError, match="contiguous"):
        regions_of([torch.zeros(4, 8)[:, ::2]])


def test_consecutive_pairs_merge_into_one_range() -> None:
    ranges = block_ranges(LOCAL, REMOTE, [(4, 2), (2, 5), (3, 1), (5, 3)])

    assert ranges == [(1_000_000 + 2 * 128, 5_000_000 + 5 * 128, 128),
                      (1_000_000 + 3 * 128, 5_000_000 + 1 * 128, 3 * 128)]


def test_every_region_moves_its_share_of_each_block() -> None:
    local = (*LOCAL, KVRegion(2_000_000, 10 * 16, 16))
    remote = (*REMOTE, KVRegion(6_000_000, 6 * 16, 16))

    assert block_ranges(local, remote, [(1, 2)]) == [(1_000_000 + 128, 5_000_000 + 256, 128),
                                                     (2_000_000 + 16, 6_000_000 + 32, 16)]


@pytest.mark.parametrize("pair", [(10, 1), (1, 6), (-1, 1)])
def test_a_block_outside_its_region_is_refused(pair: tuple[int, int]) -> None:
    with pytest.raises(ValueError, match="outside a region"):
        block_ranges(LOCAL, REMOTE, [pair])


def test_regions_of_other_block_sizes_are_refused() -> None:
    with pytest.raises(ValueError, match="cannot exchange"):
        block_ranges(LOCAL, (KVRegion(5_000_000, 6 * 64, 64),), [(1, 1)])


def test_a_region_is_a_whole_number_of_blocks() -> None:
    with pytest.raises(ValueError, match="whole number"):
        KVRegion(0, 100, 64)

"""Builders and checks the hybrid-pool tests share: small grouped layouts over a real arena."""

from __future__ import annotations

import torch

from kvpool.memory.arena import Arena
from kvpool.memory.hybrid_pool import HybridBlockPool
from kvpool.memory.kv_groups import KVGroup, kv_groups
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.sequence_blocks import SequenceBlocks

BLOCK_SIZE = 4


def gemma_like_groups(window: int = 8, num_layers: int = 6, head_dim: int = 8,
                      hybrid: bool = True) -> tuple[KVGroup, ...]:
    """Every third layer full, the others windowed: a Gemma-3-like model, small."""
    layout = KVLayout(BLOCK_SIZE, num_layers, 1, head_dim, "float32")
    windows = [None if (i + 1) % 3 == 0 else window for i in range(num_layers)]
    return kv_groups(layout, windows, hybrid)


def hybrid_pool(groups: tuple[KVGroup, ...], num_pages_of_largest: int,
                enable_prefix_caching: bool = True) -> HybridBlockPool:
    """A pool whose arena holds the null page and `num_pages_of_largest` of the largest page."""
    largest = max(group.layout.bytes_per_block for group in groups)
    arena = Arena(torch.zeros((num_pages_of_largest + 1) * largest, dtype=torch.uint8))
    return HybridBlockPool(groups, arena, enable_prefix_caching)


def assert_window_bound(seq: SequenceBlocks) -> None:
    """Each sliding group's table holds no more than its bound of live blocks (one step of one
    token in flight)."""
    for table in seq.table.tables:
        group = table.group
        if group is not None:
            assert len(table.live_block_ids) <= group.max_live_blocks, (
                f"{len(table.live_block_ids)} live blocks, bound {group.max_live_blocks}")

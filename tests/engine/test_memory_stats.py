"""`memory_stats().max_concurrency`: how many `max_model_len`-token requests the pool holds at
once (vLLM's "Maximum concurrency"), from the pool at its largest."""

from __future__ import annotations

import pytest

from kvpool.memory.block_pool import BlockPoolStats


def test_max_concurrency_is_kv_tokens_over_max_model_len(make_fast_engine):
    engine = make_fast_engine(num_gpu_blocks=100, block_size=16, max_model_len=512)
    stats = engine.memory_stats()
    assert isinstance(stats, BlockPoolStats)  # every pool field is still there
    assert stats.max_model_len == 512 and stats.max_num_blocks == 100
    assert stats.max_concurrency == pytest.approx(100 * 16 / 512)


def test_an_elastic_pool_counts_the_blocks_it_can_grow_to(make_fast_engine):
    engine = make_fast_engine(kv_pool="elastic", kv_cache_memory=64 * 2**20,
                              kv_pool_initial_blocks=8, max_model_len=256)
    stats = engine.memory_stats()
    assert stats.num_blocks < stats.max_num_blocks  # only part of it online yet
    assert stats.max_concurrency == pytest.approx(
        stats.max_num_blocks * stats.block_size / 256)

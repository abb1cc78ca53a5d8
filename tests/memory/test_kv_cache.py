"""KV tensors: slot writes land in the right block and offset; block copies copy one block."""

from __future__ import annotations

import pytest
import torch

from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_cache import KVCache, kv_bytes_per_block, num_blocks_for_memory, write_kv


def make_cache(dtype=torch.float32) -> KVCache:
    return KVCache(
        num_blocks=6, num_layers=2, block_size=4, num_kv_heads=2, head_dim=3, dtype=dtype
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_kv_lands_in_slots(dtype):
    cache = make_cache(dtype)
    key = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3) + 1
    value = -key
    slots = torch.tensor([5, 6, 17])  # block 1 offsets 1, 2; block 4 offset 1
    write_kv(cache.layer(1), key, value, slots)
    layer = cache.layer(1)
    assert torch.equal(layer[1, 0, 1], key[0].to(dtype))
    assert torch.equal(layer[1, 1, 2], value[1].to(dtype))
    assert torch.equal(layer[4, 0, 1], key[2].to(dtype))
    # nothing else was touched: three K rows and three V rows are non-zero
    assert int((cache.tensor != 0).any(dim=-1).any(dim=-1).sum()) == 6
    assert not cache.layer(0).any()


def test_copy_blocks_copies_exactly_one_block_across_layers():
    cache = make_cache()
    cache.tensor.copy_(torch.randn_like(cache.tensor))
    before = cache.tensor.clone()
    cache.copy_blocks([BlockCopy(src_block_id=2, dst_block_id=5)])
    assert torch.equal(cache.tensor[5], before[2])
    assert torch.equal(cache.tensor[:5], before[:5])


def test_copy_blocks_reads_sources_before_writing():
    cache = make_cache()
    cache.tensor.copy_(torch.randn_like(cache.tensor))
    before = cache.tensor.clone()
    cache.copy_blocks([BlockCopy(0, 1), BlockCopy(1, 2)])
    assert torch.equal(cache.tensor[1], before[0])
    assert torch.equal(cache.tensor[2], before[1])


def test_sizes_and_storage():
    per_block = kv_bytes_per_block(2, 4, 2, 3, torch.bfloat16)
    assert per_block == 2 * 2 * 4 * 2 * 3 * 2
    assert num_blocks_for_memory(10 * per_block + 5, per_block) == 10
    with pytest.raises(ValueError, match="cannot hold one block"):
        num_blocks_for_memory(per_block - 1, per_block)
    storage = torch.zeros(3 * per_block, dtype=torch.uint8)
    cache = KVCache(3, 2, 4, 2, 3, dtype=torch.bfloat16, storage=storage)
    cache.layer(0)[2, 1, 3] = 1.0
    assert storage.any()  # the cache is a view over the given bytes
    with pytest.raises(ValueError, match="KV dtype"):
        KVCache(1, 1, 1, 1, 1, dtype=torch.int8)

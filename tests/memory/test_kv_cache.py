"""KV tensors: slot writes land in the right block and offset; block copies copy one block;
the layout owns every size and the null block stays zero."""

from __future__ import annotations

import pytest
import torch

from kvpool.attention.kv_write import write_kv_reference
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_quant import dequantize, qmax
from kvpool.model import presets

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=3)


def make_cache(dtype="float32") -> KVCache:
    return KVCache(KVLayout(4, 2, 2, 3, dtype), num_blocks=6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_write_kv_lands_in_slots(dtype):
    cache = make_cache(dtype)
    torch_dtype = cache.layout.torch_dtype
    key = torch.arange(3 * 2 * 3, dtype=torch.float32).view(3, 2, 3) + 1
    value = -key
    slots = torch.tensor([5, 6, 17])  # block 1 offsets 1, 2; block 4 offset 1
    write_kv_reference(cache.layer(1), key, value, slots)
    layer = cache.layer(1)
    assert torch.equal(layer[1, 0, 1], key[0].to(torch_dtype))
    assert torch.equal(layer[1, 1, 2], value[1].to(torch_dtype))
    assert torch.equal(layer[4, 0, 1], key[2].to(torch_dtype))
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
    cache.copy_blocks([BlockCopy(1, 2), BlockCopy(2, 3)])
    assert torch.equal(cache.tensor[2], before[1])
    assert torch.equal(cache.tensor[3], before[2])


def test_the_layout_owns_sizes_slots_and_block_counts():
    layout = KVLayout(4, 2, 2, 3, "bfloat16")
    assert layout.bytes_per_block == 2 * 2 * 4 * 2 * 3 * 2 == 4 * layout.bytes_per_token
    assert layout.num_blocks_for_memory(10 * layout.bytes_per_block + 5) == 10
    with pytest.raises(ValueError, match="cannot hold one block"):
        layout.num_blocks_for_memory(layout.bytes_per_block - 1)
    assert [layout.num_blocks_for_tokens(n) for n in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert layout.slot([7, 3], 5) == 3 * 4 + 1
    assert layout.slot_mapping([7, 3], 2, 6) == [30, 31, 12, 13]
    assert layout.tensor_shape(3) == (3, 2, 2, 4, 2, 3)
    with pytest.raises(ValueError, match="KV dtype"):
        KVLayout(dtype="int4")
    with pytest.raises(ValueError, match="block_size"):
        KVLayout(block_size=0)


def test_storage_is_viewed_and_its_null_block_zeroed():
    layout = KVLayout(4, 2, 2, 3, "bfloat16")
    storage = torch.full((3 * layout.bytes_per_block,), 0xFF, dtype=torch.uint8)
    cache = KVCache(layout, 3, storage=storage)
    assert not cache.tensor[0].view(torch.uint8).any(), "the null block is zero"
    cache.layer(0)[2, 1, 3] = 1.0
    assert cache.tensor.data_ptr() == storage.data_ptr()  # a view over the given bytes
    with pytest.raises(ValueError, match="at least"):
        KVCache(layout, 4, storage=storage)


def test_a_tensor_of_another_layout_is_refused():
    cache = make_cache()
    with pytest.raises(AssertionError, match="does not match"):
        KVLayout(8, 2, 2, 3).check_tensor(cache.tensor)


# ------------------------------------------------------------------ quantized KV
def test_quantized_bytes_per_block_count_the_scales():
    layout = KVLayout(16, 30, 3, 64, "int8")  # SmolLM2-135M's shape
    assert layout.is_quantized and not KVLayout(16, 30, 3, 64, "bfloat16").is_quantized
    assert layout.kv_bytes_per_block == 16 * 30 * 2 * 3 * 64
    assert layout.scale_bytes_per_block == 16 * 30 * 2 * 3 * 4  # one float32 per row
    assert layout.bytes_per_block == layout.kv_bytes_per_block + layout.scale_bytes_per_block
    fp32, bf16 = KVLayout(16, 30, 3, 64, "float32"), KVLayout(16, 30, 3, 64, "bfloat16")
    assert fp32.bytes_per_block / layout.bytes_per_block >= 3.5
    assert bf16.bytes_per_block / layout.bytes_per_block >= 1.75
    assert layout.num_blocks_for_memory(2**30) == 2**30 // layout.bytes_per_block


@pytest.mark.parametrize("option, storage", [
    ("int8", "int8"), ("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn"),
    ("fp8_e5m2", "float8_e5m2"), ("auto", "bfloat16"), ("float16", "float16"),
])
def test_kv_cache_dtype_options_resolve_to_a_storage_dtype(option, storage):
    config = presets.preset("tiny")
    layout = config.kv_layout(16, torch.bfloat16, option)
    assert layout.dtype == storage
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        config.kv_layout(16, torch.bfloat16, "int4")
    # The model's constructor is the memory core's, fed the model's numbers.
    assert layout == KVLayout.resolve(16, config.num_layers, config.num_kv_heads,
                                      config.head_dim, "bfloat16", option)


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
def test_quantized_write_stores_codes_and_scales_that_decode_close(dtype):
    layout = KVLayout(4, 1, 2, 16, dtype)
    cache = KVCache(layout, num_blocks=4)
    assert cache.scales is not None and cache.scales.shape == (4, 1, 2, 4, 2)
    key, value = torch.randn(5, 2, 16), torch.randn(5, 2, 16) * 100
    key[0, 1] = 0.0  # an all-zero row: scale 1, codes 0
    slots = torch.tensor([4, 5, 6, 7, 9])
    write_kv_reference(cache.layer(0), key, value, slots, cache.layer_scales(0))
    for plane, rows in ((0, key), (1, value)):
        codes = cache.layer(0)[slots // 4, plane, slots % 4]
        scales = cache.layer_scales(0)[slots // 4, plane, slots % 4]
        amax = rows.abs().amax(-1)
        assert torch.equal(scales, torch.where(amax > 0, amax / qmax(layout.torch_dtype), 1.0))
        decoded = dequantize(codes, scales, torch.float32)
        relative = (decoded - rows).norm() / rows.norm()
        assert relative < {"int8": 0.01, "float8_e4m3fn": 0.04, "float8_e5m2": 0.08}[dtype]
        # The largest element of each row is its code's largest magnitude, exactly.
        assert torch.allclose(codes.float().abs().amax(-1)[scales != 1],
                              torch.tensor(qmax(layout.torch_dtype)))
    assert cache.layer_scales(0)[1, 0, 0, 1] == 1.0 and not cache.layer(0)[1, 0, 0, 1].any()


def test_copy_blocks_moves_codes_and_scales_together():
    cache = KVCache(KVLayout(2, 2, 1, 4, "int8"), num_blocks=4)
    cache.tensor[1] = 7
    cache.scales[1] = 0.5
    cache.copy_blocks([BlockCopy(src_block_id=1, dst_block_id=3)])
    assert torch.equal(cache.tensor[3], cache.tensor[1])
    assert torch.equal(cache.scales[3], cache.scales[1])
    assert not cache.tensor[2].any() and torch.equal(cache.scales[2], torch.ones(2, 2, 2, 1))

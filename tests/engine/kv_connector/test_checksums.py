"""Per-block checksums: equal bytes give equal checksums, one flipped bit in any region of a
block is caught, and `verify_blocks` names exactly the blocks that differ."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.kv_connector.checksums import block_checksums, verify_blocks
from kvpool.engine.kv_connector.errors import KVTransferError
from kvpool.engine.kv_connector.regions import kv_tensors
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout


def cache(dtype: str, seed: int = 0) -> KVCache:
    layout = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=4, dtype=dtype)
    kv = KVCache(layout, num_blocks=4)
    generator = torch.Generator().manual_seed(seed)
    kv.tensor.copy_(torch.randint(-100, 100, kv.tensor.shape, generator=generator))
    if kv.scales is not None:
        kv.scales.copy_(torch.rand(kv.scales.shape, generator=generator))
    return kv


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "int8"])
def test_equal_blocks_have_equal_checksums(dtype: str) -> None:
    one, two = cache(dtype), cache(dtype)

    assert block_checksums(kv_tensors(one), [1, 2, 3]) == block_checksums(kv_tensors(two),
                                                                          [1, 2, 3])
    assert len(set(block_checksums(kv_tensors(one), [1, 2, 3]))) == 3


@pytest.mark.parametrize("region", [0, 1], ids=["codes", "scales"])
def test_one_flipped_bit_in_any_region_is_caught(region: int) -> None:
    kv = cache("int8")
    tensors = kv_tensors(kv)
    pairs = [(1, 1), (2, 2), (3, 3)]
    expected = block_checksums(tensors, [1, 2, 3])
    verify_blocks(tensors, pairs, expected)

    tensors[region][2].view(-1).view(torch.uint8)[5] ^= 0x01

    with pytest.raises(KVTransferError, match=r"1 of 3 blocks differ.*\[\(2, 2\)\]") as caught:
        verify_blocks(tensors, pairs, expected)
    assert caught.value.reason == "checksum"


def test_checksums_are_matched_to_pairs_by_position() -> None:
    source, copy = cache("float32", seed=1), KVCache(cache("float32").layout, num_blocks=4)
    copy.tensor[1] = source.tensor[3]
    copy.tensor[2] = source.tensor[1]

    verify_blocks(kv_tensors(copy), [(1, 3), (2, 1)], block_checksums(kv_tensors(source), [3, 1]))
    with pytest.raises(KVTransferError, match="2 of 2"):
        verify_blocks(kv_tensors(copy), [(1, 1), (2, 3)],
                      block_checksums(kv_tensors(source), [1, 3]))


def test_a_count_that_does_not_match_is_refused() -> None:
    with pytest.raises(ValueError, match="2 checksums for 1 blocks"):
        verify_blocks(kv_tensors(cache("float32")), [(1, 1)], [0, 0])

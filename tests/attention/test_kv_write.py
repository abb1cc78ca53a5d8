"""The KV write op's one home: every path asserts the same contract before it writes, and the
dispatching `write_kv` equals the reference on whatever path serves the tensors."""

from __future__ import annotations

import pytest
import torch

from kvpool.attention.kv_write import check_write_kv, write_kv, write_kv_reference


def _layer(dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(4, 2, 4, 2, 8, dtype=dtype)  # [blocks, K/V, block_size, Hkv, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_write_kv_equals_the_reference_on_any_path(dtype):
    key = torch.randn(3, 2, 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    slots = torch.tensor([4, 5, 13])
    expected, actual = _layer(dtype), _layer(dtype)
    write_kv_reference(expected, key, -key, slots)
    write_kv(actual, key, -key, slots)
    assert torch.equal(actual, expected)
    assert torch.equal(actual[1, 0, 0], key[0]) and torch.equal(actual[3, 1, 1], -key[2])


def test_the_contract_names_what_is_wrong():
    key, slots = torch.zeros(3, 2, 8), torch.tensor([0, 1, 2])
    with pytest.raises(AssertionError, match="same shape"):
        check_write_kv(_layer(torch.float32), key, key[:2], slots, None)
    with pytest.raises(AssertionError, match="heads/dim"):
        check_write_kv(_layer(torch.float32), torch.zeros(3, 1, 8), torch.zeros(3, 1, 8),
                       slots, None)
    with pytest.raises(AssertionError, match="one slot per new token"):
        check_write_kv(_layer(torch.float32), key, key, slots[:2], None)
    with pytest.raises(AssertionError, match="has no scales"):
        check_write_kv(_layer(torch.float32), key, key, slots, torch.ones(4, 2, 4, 2))
    with pytest.raises(AssertionError, match="needs kv_scales"):
        check_write_kv(_layer(torch.int8), key, key, slots, None)
    with pytest.raises(AssertionError, match="float32"):
        check_write_kv(_layer(torch.int8), key, key, slots, torch.ones(4, 2, 4, 2).double())
    check_write_kv(_layer(torch.int8), key, key, slots, torch.ones(4, 2, 4, 2))

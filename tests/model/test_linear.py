"""`Linear`: packed for oneDNN it computes what `F.linear` computes, and gives its plain weight
back unless another module shares it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kvpool.model.linear import Linear, can_pack
from kvpool.model.loaders.auto import load_model

needs_onednn = pytest.mark.skipif(not can_pack(torch.empty(1)), reason="no oneDNN matmul here")


def make_linear(dtype: torch.dtype, bias: bool, seed: int = 0) -> Linear:
    generator = torch.Generator().manual_seed(seed)
    linear = Linear(48, 80, bias, dtype, "cpu")
    with torch.no_grad():
        linear.weight.copy_(torch.randn(80, 48, generator=generator))
        if bias:
            linear.bias.copy_(torch.randn(80, generator=generator))
    return linear


@needs_onednn
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 3, 64, 200])
def test_packed_equals_plain(dtype, tolerance, bias, batch):
    linear = make_linear(dtype, bias)
    x = torch.randn(batch, 48).to(dtype)
    expected = F.linear(x, linear.weight, linear.bias)
    if not can_pack(linear.weight):  # a CPU without bf16 matmuls: the plain path stays
        assert not linear.pack() and not linear.is_packed
        torch.testing.assert_close(linear(x), expected, atol=0, rtol=0)
        return
    assert linear.pack() and linear.is_packed and linear.pack()  # packing twice is a no-op
    torch.testing.assert_close(linear(x), expected, atol=tolerance * 10, rtol=tolerance)
    assert linear.weight.numel() == 0, "the plain weight was released"


@needs_onednn
def test_a_shared_weight_is_kept_and_three_dimensional_inputs_work():
    table = nn.Parameter(torch.randn(80, 48), requires_grad=False)
    head = Linear(48, 80, False, torch.float32, "cpu", weight=table)
    x = torch.randn(2, 5, 48)
    expected = F.linear(x, table)
    assert head.pack()
    assert head.weight is table and table.numel() == 80 * 48
    torch.testing.assert_close(head(x), expected, atol=1e-4, rtol=1e-5)


def test_packing_can_be_switched_off_and_other_devices_stay_plain(monkeypatch):
    monkeypatch.setenv("KVPOOL_PACKED_LINEARS", "0")
    linear = make_linear(torch.float32, bias=False)
    assert not linear.pack() and not linear.is_packed and linear.weight.numel() == 80 * 48
    monkeypatch.delenv("KVPOOL_PACKED_LINEARS")
    assert not can_pack(torch.empty(1, device="meta"))
    assert not can_pack(torch.empty(1, dtype=torch.float16))


@needs_onednn
def test_a_loaded_model_is_packed_and_refuses_to_load_weights_again():
    loaded = load_model("tiny", load_format="dummy")
    assert all(linear.is_packed for linear in loaded.model.linears())
    with pytest.raises(ValueError, match="packed for inference"):
        loaded.model.load_weights([])

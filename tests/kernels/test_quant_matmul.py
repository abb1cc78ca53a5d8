"""`quant_matmul`: the layout round-trips, the C++ kernel computes what its PyTorch reference
computes, and the reference is x Wᵀ up to the activations' int8 rounding (an exact bound)."""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels.group_quant import quantize
from kvpool.kernels.quant_matmul import (
    is_served,
    pack,
    quant_matmul,
    quant_matmul_reference,
    quantize_activations,
    unpack,
)

SHAPES = [(1, 64), (16, 64), (33, 128), (192, 576), (40, 256)]  # (rows N, columns K)
GROUPS = [16, 32, 64]


def _weight(rows: int, cols: int, bits: int, group: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return quantize(torch.randn(rows, cols, generator=generator), bits, group)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("rows, cols", SHAPES)
def test_the_layout_round_trips(bits, group, rows, cols):
    weight = _weight(rows, cols, bits, group)
    back = unpack(pack(weight))
    assert torch.equal(back.codes, weight.codes)
    assert torch.equal(back.scales, weight.scales) and torch.equal(back.mins, weight.mins)
    ids = torch.tensor([rows - 1, 0, rows // 2, rows - 1])
    some = unpack(pack(weight), ids)
    assert torch.equal(some.dequantize(), weight.dequantize()[ids])


def test_the_kernel_is_built_here():
    assert is_served(torch.zeros(1, 8))  # else the tests below only test the reference


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("rows, cols", SHAPES)
@pytest.mark.parametrize("tokens", [1, 3, 4, 9])
def test_the_kernel_computes_its_reference(bits, group, rows, cols, tokens):
    packed = pack(_weight(rows, cols, bits, group))
    x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(1))
    reference = quant_matmul_reference(x.double(), packed)
    out = quant_matmul(x, packed)
    assert out.shape == (tokens, rows) and out.dtype == torch.float32
    # float32 sums over K / group terms in another order than the float64 reference
    torch.testing.assert_close(out.double(), reference, rtol=1e-5, atol=1e-5 * cols**0.5)
    out_bf16 = quant_matmul(x.bfloat16(), packed)
    assert out_bf16.dtype == torch.bfloat16
    bf16_reference = quant_matmul_reference(x.bfloat16().double(), packed)
    # each output rounded once to bfloat16: within half its unit in the last place (2^-8)
    error = (out_bf16.double() - bf16_reference).abs()
    assert (error <= 2**-8 * bf16_reference.abs() * (1 + 1e-3) + 1e-5 * cols**0.5).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
def test_the_reference_is_the_float_matmul_up_to_the_activations_rounding(bits, group):
    rows, cols = 48, 256
    weight = _weight(rows, cols, bits, group)
    x = torch.randn(5, cols, generator=torch.Generator().manual_seed(2)).double()
    exact = x @ weight.dequantize().double().T
    out = quant_matmul_reference(x, pack(weight))
    # Each activation moves by at most half its group's step (scale = max|x| / 127).
    _, x_scales, _ = quantize_activations(x, group)
    half_steps = (x_scales.double() / 2).repeat_interleave(group, dim=1)  # [tokens, cols]
    bound = half_steps @ weight.dequantize().double().abs().T
    assert ((out - exact).abs() <= bound * (1 + 1e-9) + 1e-9).all()


def test_an_all_zero_group_and_padded_rows():
    weight = _weight(17, 64, 4, 32)
    x = torch.randn(2, 64)
    x[:, :32] = 0  # scale 0 for the first group
    out = quant_matmul(x, pack(weight))
    torch.testing.assert_close(out.double(), quant_matmul_reference(x.double(), pack(weight)),
                               rtol=1e-5, atol=1e-5)


def test_leading_dimensions_are_kept():
    packed = pack(_weight(32, 64, 8, 32))
    x = torch.randn(2, 3, 64)
    assert quant_matmul(x, packed).shape == (2, 3, 32)


def test_a_group_the_kernel_cannot_take_is_refused():
    with pytest.raises(ValueError, match="multiples of 8"):
        pack(quantize(torch.randn(16, 36), 4, 12))

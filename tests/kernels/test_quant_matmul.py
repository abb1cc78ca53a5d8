"""`quant_matmul`: the layout round-trips, each C++ kernel (integer for decode, dequantizing for
prefill) computes what its PyTorch reference computes, and the integer kernel's reference is
x Wᵀ up to the activations' rounding (an exact bound)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvpool.kernels.group_quant import quantize
from kvpool.kernels.quant_matmul import (
    DEQUANTIZED_FROM,
    MAX_GROUP,
    RESIDUAL_STEPS,
    dequant_matmul_reference,
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
    # Each activation moves by at most half of a 16th of its group's step (max|x| / 127).
    _, _, x_scales, _ = quantize_activations(x, group)
    half_steps = (x_scales.double() / 2 / RESIDUAL_STEPS).repeat_interleave(group, dim=1)
    bound = half_steps @ weight.dequantize().double().abs().T
    assert ((out - exact).abs() <= bound * (1 + 1e-9) + 1e-9).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", GROUPS)
@pytest.mark.parametrize("rows, cols", [*SHAPES, (4100, 64)])  # the last: several tiles a thread
def test_the_dequantizing_kernel_computes_its_reference(bits, group, rows, cols):
    packed = pack(_weight(rows, cols, bits, group))
    x = torch.randn(DEQUANTIZED_FROM + 3, cols, generator=torch.Generator().manual_seed(1))
    out = quant_matmul(x, packed)
    exact = x.double() @ unpack(packed).dequantize().double().T  # float32 weights: exact
    torch.testing.assert_close(out.double(), exact, rtol=1e-5, atol=1e-5 * cols**0.5)
    x = x.bfloat16()
    reference = dequant_matmul_reference(x.double(), packed)  # float32 weights, not bf16 ones
    bf16_weights = unpack(packed).dequantize().bfloat16().double()
    bf16_reference = x.double() @ bf16_weights.T
    out_bf16 = quant_matmul(x, packed)
    assert out_bf16.dtype == torch.bfloat16
    # bfloat16 weights as the dequantized model holds them, each output rounded once
    error = (out_bf16.double() - bf16_reference).abs()
    assert (error <= 2**-8 * bf16_reference.abs() * (1 + 1e-3) + 1e-5 * cols**0.5).all()
    assert not torch.allclose(bf16_reference, reference, rtol=0, atol=0)  # the test can tell


def test_the_dequantizing_kernel_runs_in_inference_mode():
    """The engine's mode: the pool's threads must take it on to write the output."""
    packed = pack(_weight(40, 64, 4, 32))
    with torch.inference_mode():
        x = torch.randn(DEQUANTIZED_FROM, 64)
        torch.testing.assert_close(quant_matmul(x, packed), dequant_matmul_reference(x, packed))


@pytest.mark.parametrize("value, expected", [("1000000", "False"), ("7", "True"),
                                             ("lots", "must be a number of tokens, not 'lots'")])
def test_the_threshold_can_be_moved_for_measurements(value, expected):
    code = "from kvpool.kernels.quant_matmul import dequantizes; print(dequantizes(200))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={**os.environ, "KVPOOL_DEQUANTIZED_FROM": value}, timeout=300)
    assert expected in result.stdout + result.stderr


def test_the_kernels_split_at_the_threshold():
    packed = pack(_weight(48, 256, 4, 32))
    x = torch.randn(DEQUANTIZED_FROM, 256, generator=torch.Generator().manual_seed(3))
    below, at = quant_matmul(x[:-1], packed).double(), quant_matmul(x, packed).double()
    torch.testing.assert_close(below, quant_matmul_reference(x[:-1].double(), packed),
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(at, dequant_matmul_reference(x.double(), packed),
                               rtol=1e-5, atol=1e-4)
    assert not torch.allclose(at[:-1], below, rtol=0, atol=1e-6)  # two kernels, not one


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
    with pytest.raises(ValueError, match="up to 512"):
        pack(quantize(torch.randn(16, 2 * MAX_GROUP + 16), 8, MAX_GROUP + 8))


def test_the_largest_group_at_the_largest_codes_stays_exact():
    """128 · Σ code · x code peaks at 255 · 127 · 512 · 128 < 2³¹: no integer overflow."""
    weight = torch.ones(16, MAX_GROUP)
    weight[:, 0] = 0  # min 0, every other weight code 255
    quantized = quantize(weight, 8, MAX_GROUP)
    packed = pack(quantized)
    x = torch.full((3, MAX_GROUP), 1.0)  # every activation code 127, residual 0
    expected = (x @ quantized.dequantize().T).double()
    assert torch.allclose(quant_matmul_reference(x, packed).double(), expected, rtol=1e-6)
    assert torch.allclose(quant_matmul(x, packed).double(), expected, rtol=1e-6)

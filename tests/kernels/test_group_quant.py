"""`GroupQuantized`: kvpool's own int4/int8 quantization, and the exact row and column
operations a model's loading needs (fused parts stacked, tensor-parallel slices)."""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels.group_quant import GroupQuantized, concat_rows, quantize


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [16, 32, 128])
def test_quantize_rounds_each_weight_to_its_groups_nearest_step(bits, group):
    weight = torch.randn(24, 256, generator=torch.Generator().manual_seed(0))
    quantized = quantize(weight, bits, group)
    assert quantized.codes.max() <= 2**bits - 1 and quantized.group == group
    step = quantized.scales.float().repeat_interleave(group, dim=1)
    error = (quantized.dequantize() - weight).abs()
    # half a step, plus the float16 rounding of the min and of the top code's scale
    slack = 2**-10 * (weight.abs() + step * 2**bits)
    assert (error <= step / 2 + slack).all()


def test_a_constant_group_is_exact():
    weight = torch.full((2, 32), 0.375)
    assert torch.equal(quantize(weight, 4, 32).dequantize(), weight)


def test_concat_rows_widens_codes_and_narrows_groups_exactly():
    four = quantize(torch.randn(16, 64), 4, 32)
    eight = quantize(torch.randn(8, 64), 8, 16)
    stacked = concat_rows([four, eight])
    assert stacked.bits == 8 and stacked.group == 16 and stacked.shape == (24, 64)
    assert torch.equal(stacked.dequantize(),
                       torch.cat([four.dequantize(), eight.dequantize()]))


def test_narrow_and_split_cut_rows_and_whole_groups():
    weight = quantize(torch.randn(12, 128), 4, 32)
    dense = weight.dequantize()
    assert torch.equal(weight.narrow(1, 64, 64).dequantize(), dense[:, 64:])
    parts = weight.split([4, 6, 2])
    assert [part.shape for part in parts] == [(4, 128), (6, 128), (2, 128)]
    assert torch.equal(parts[1].dequantize(), dense[4:10])
    with pytest.raises(ValueError, match="cut through groups"):
        weight.narrow(1, 16, 64)


def test_malformed_parts_are_refused():
    codes = torch.zeros(4, 64, dtype=torch.uint8)
    halves = torch.zeros(4, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match="equal groups"):
        GroupQuantized(codes, halves, halves, 4)
    with pytest.raises(ValueError, match="bits"):
        GroupQuantized(codes, halves[:, :2], halves[:, :2], 3)

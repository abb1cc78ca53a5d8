"""A step's decode rows take the integer kernel whatever shares the step, so each row's result
is the same as computed alone; prompt rows take the kernel their own count picks."""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels import quant_matmul as qm
from kvpool.kernels.decode_rows import leading_decode_rows
from kvpool.kernels.group_quant import quantize

NUM_ROWS = qm.DEQUANTIZED_FROM + 40  # enough rows that the batch as a whole dequantizes


@pytest.fixture(scope="module")
def weight():
    generator = torch.Generator().manual_seed(0)
    return qm.pack(quantize(torch.randn(48, 64, generator=generator), 4, 32))


@pytest.fixture(scope="module")
def x():
    return torch.randn(NUM_ROWS, 64, generator=torch.Generator().manual_seed(1))


def alone(x, weight, rows):
    """Each row computed in a matmul of its own (the integer kernel)."""
    return torch.cat([qm.quant_matmul(x[row : row + 1], weight) for row in rows])


@pytest.mark.parametrize("num_decodes", [1, 7, 40])
def test_leading_decode_rows_equal_themselves_alone(weight, x, num_decodes):
    with leading_decode_rows(num_decodes):
        out = qm.quant_matmul(x, weight)
    assert torch.equal(out[:num_decodes], alone(x, weight, range(num_decodes)))
    prompts = x[num_decodes:]  # still enough to dequantize, by their own count
    assert torch.equal(out[num_decodes:], qm.quant_matmul(prompts, weight))


def test_few_prompt_rows_beside_decodes_take_the_integer_kernel(weight, x):
    num_decodes = NUM_ROWS - 3
    with leading_decode_rows(num_decodes):
        out = qm.quant_matmul(x, weight)
    assert torch.equal(out, alone(x, weight, range(NUM_ROWS)))


def test_a_mask_picks_the_decode_rows_anywhere(weight, x):
    is_decode = torch.zeros(NUM_ROWS, dtype=torch.bool)
    is_decode[::3] = True
    with leading_decode_rows(lambda: is_decode):
        out = qm.quant_matmul(x, weight)
    decode_rows = is_decode.nonzero().flatten().tolist()
    assert torch.equal(out[is_decode], alone(x, weight, decode_rows))
    assert torch.equal(out[~is_decode], qm.quant_matmul(x[~is_decode], weight))


def test_outside_a_step_every_row_counts_as_a_prompt_row(weight, x):
    assert torch.equal(qm.quant_matmul(x, weight), qm.dequant_matmul_reference(x, weight)
                       if not qm.is_served(x) else
                       torch.ops.kvpool_cpu.dequant_matmul(x, weight.data, weight.bits,
                                                           weight.group, weight.rows))

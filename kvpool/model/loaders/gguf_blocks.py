"""GGML quantized blocks as `GroupQuantized`, so a GGUF's quantized matrices stay quantized in
memory: the stored quants become the codes unchanged, each block's (sub-block) scale the group's
scale, and the offset the min.

    type   bits  group  scale     min          (d, dmin: the block's float16 fields)
    Q4_0   4     32     d         -8 d
    Q4_1   4     32     d         m
    Q5_0   8     32     d         -16 d        (5-bit quants in 8-bit codes)
    Q5_1   8     32     d         m
    Q8_0   8     32     d         -128 d       (codes are the int8 quants + 128)
    Q4_K   4     32     d sc      -dmin m      (sc, m: the 6-bit sub-block scale and min)
    Q5_K   8     32     d sc      -dmin m
    Q6_K   8     16     d sc      -32 d sc     (sc: the int8 sub-block scale)

The first five are exact: every scale and min is a float16 times a power of two, and
code * scale + min then equals ggml's float32 weight bit for bit. The K-quants' products d sc
and dmin m are rounded to float16 (relative error at most 2^-11); Q6_K's min is -32 times that
rounded scale, so its weights stay exactly (quant - 32) * scale. A scale or min past float16's
range raises `ValueError`: the caller dequantizes such a tensor instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from kvpool.kernels.group_quant import GroupQuantized
from kvpool.model.loaders.ggml_fields import (
    as_blocks,
    f16,
    five_bit_quants,
    k_scales_mins,
    nibbles,
    q4_k_quants,
    q5_k_quants,
    q6_k_quants,
    q6_k_scales,
)

Q = GGMLQuantizationType
# blocks [num_blocks, block_bytes] uint8 -> codes [num_blocks, block_numel] uint8, and float16
# scales and mins [num_blocks, block_numel / group].
Fields = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class BlockForm:
    """How one GGML block type maps onto `GroupQuantized`."""

    bits: int
    convert: Callable[[torch.Tensor], Fields]


def _half(values: torch.Tensor) -> torch.Tensor:
    """float32 values rounded to float16, refusing any that overflow it."""
    rounded = values.to(torch.float16)
    overflow = rounded.isinf() & values.isfinite()
    if overflow.any():
        largest = values[overflow].abs().max().item()
        raise ValueError(f"a scale or min of {largest:g} overflows float16: dequantize instead")
    return rounded


def _symmetric(d: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale d, min -offset d): the min is exact, `offset` being a power of two."""
    return _half(d), _half(-offset * d)


def _q4_0(blocks: torch.Tensor) -> Fields:
    return nibbles(blocks[:, 2:], 16), *_symmetric(f16(blocks, 0), 8)


def _q4_1(blocks: torch.Tensor) -> Fields:
    return nibbles(blocks[:, 4:], 16), _half(f16(blocks, 0)), _half(f16(blocks, 2))


def _q5_0(blocks: torch.Tensor) -> Fields:
    return five_bit_quants(blocks, 2), *_symmetric(f16(blocks, 0), 16)


def _q5_1(blocks: torch.Tensor) -> Fields:
    return five_bit_quants(blocks, 4), _half(f16(blocks, 0)), _half(f16(blocks, 2))


def _q8_0(blocks: torch.Tensor) -> Fields:
    # Flipping the sign bit of a two's-complement int8 q gives the uint8 q + 128.
    return blocks[:, 2:] ^ 0x80, *_symmetric(f16(blocks, 0), 128)


def _k_scale_min(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight sub-block scales d sc and mins -dmin m. # [num_blocks, 8] float16"""
    scales, mins = k_scales_mins(blocks[:, 4:16])
    return _half(f16(blocks, 0) * scales.float()), _half(-f16(blocks, 2) * mins.float())


def _q4_k(blocks: torch.Tensor) -> Fields:
    return q4_k_quants(blocks), *_k_scale_min(blocks)


def _q5_k(blocks: torch.Tensor) -> Fields:
    return q5_k_quants(blocks), *_k_scale_min(blocks)


def _q6_k(blocks: torch.Tensor) -> Fields:
    scales = _half(f16(blocks, 208) * q6_k_scales(blocks))  # [num_blocks, 16]
    return q6_k_quants(blocks), scales, _half(-32 * scales.float())


FORMS: dict[GGMLQuantizationType, BlockForm] = {
    Q.Q4_0: BlockForm(4, _q4_0),
    Q.Q4_1: BlockForm(4, _q4_1),
    Q.Q5_0: BlockForm(8, _q5_0),
    Q.Q5_1: BlockForm(8, _q5_1),
    Q.Q8_0: BlockForm(8, _q8_0),
    Q.Q4_K: BlockForm(4, _q4_k),
    Q.Q5_K: BlockForm(8, _q5_k),
    Q.Q6_K: BlockForm(8, _q6_k),
}
# The types kept quantized; the caller dequantizes every other.
KEPT_TYPES: frozenset[GGMLQuantizationType] = frozenset(FORMS)


def to_group_quantized(raw: torch.Tensor, ggml_type: GGMLQuantizationType,
                       shape: tuple[int, int]) -> GroupQuantized:
    """The raw bytes of a GGML matrix of torch `shape` [N, K] (rows are output features, each
    row a whole number of blocks) as `GroupQuantized`, on `raw`'s device."""
    form = FORMS.get(ggml_type)
    if form is None:
        raise ValueError(f"{ggml_type.name} blocks are not kept quantized; dequantize them")
    rows, cols = shape
    block_numel, _ = GGML_QUANT_SIZES[ggml_type]
    if cols % block_numel:
        raise ValueError(f"{ggml_type.name} rows of {cols} weights are not whole blocks of "
                         f"{block_numel}")
    codes, scales, mins = form.convert(as_blocks(raw, ggml_type, shape))
    return GroupQuantized(codes.reshape(rows, cols), scales.reshape(rows, -1),
                          mins.reshape(rows, -1), form.bits)

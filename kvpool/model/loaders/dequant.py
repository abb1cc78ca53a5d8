"""GGML tensor dequantization in vectorised PyTorch, on whatever device the raw bytes sit.

A GGML tensor is a flat run of fixed-size *blocks*; each block packs `block_numel` weights with
their scale (and minimum) as float16. Every kernel here turns a `[num_blocks, block_bytes]` uint8
tensor into `[num_blocks, block_numel]` float32 with no Python loop over blocks, computing in the
same order as ggml's reference so that results are bit-identical to `gguf.quants.dequantize`
(the test oracle). Types without a kernel here fall back to that numpy reference on the CPU.
The fields of each block are read by `ggml_fields`, shared with `gguf_blocks`.

Block layouts (bytes, in order):
    Q4_0  d:f16 | qs[16]                     w = (nibble - 8) * d
    Q4_1  d:f16 | m:f16 | qs[16]             w = nibble * d + m
    Q5_0  d:f16 | qh[4] | qs[16]             w = ((nibble | bit << 4) - 16) * d
    Q5_1  d:f16 | m:f16 | qh[4] | qs[16]     w = (nibble | bit << 4) * d + m
    Q8_0  d:f16 | qs[32] int8                w = q * d
    Q4_K  d:f16 | dmin:f16 | scales[12] | qs[128]            (8 sub-blocks of 32, 6-bit scale/min)
    Q5_K  d:f16 | dmin:f16 | scales[12] | qh[32] | qs[128]
    Q6_K  ql[128] | qh[64] | scales[16] int8 | d:f16        (16 sub-blocks of 16)
In the 32-weight types the low nibbles hold weights 0..15 and the high nibbles 16..31.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_reference_dequantize

from kvpool.model.loaders.ggml_fields import (
    as_blocks,
    f16,
    five_bit_quants,
    k_scales_mins,
    q4_k_quants,
    q5_k_quants,
    q6_k_quants,
    q6_k_scales,
)

Kernel = Callable[[torch.Tensor], torch.Tensor]


# (device, offset) -> [2, 256] float32: byte b's low and high nibble, minus offset.
_NIBBLE_TABLES: dict[tuple[torch.device, int], torch.Tensor] = {}


def _nibble_values(packed: torch.Tensor, offset: int) -> torch.Tensor:
    """Nibbles minus `offset` as float32, low nibbles first, in one table gather (the fast path
    for the common 4-bit types). # [num_blocks, 16] uint8 -> [num_blocks, 2, 16] float32"""
    table = _NIBBLE_TABLES.get((packed.device, offset))
    if table is None:
        byte = torch.arange(256, device=packed.device)
        table = torch.stack([byte & 0x0F, byte >> 4]).float() - offset  # [2, 256]
        _NIBBLE_TABLES[(packed.device, offset)] = table
    return table[:, packed.int()].permute(1, 0, 2)  # strided view of [2, num_blocks, 16]


def _scaled_nibbles(blocks: torch.Tensor, qs_start: int, offset: int) -> torch.Tensor:
    """d * (nibble - offset) for a 32-weight block with d at byte 0. # [num_blocks, 2, 16]"""
    out = torch.empty(blocks.shape[0], 2, 16, device=blocks.device)
    # mul then add (not addcmul): a fused multiply-add would round differently from ggml.
    values = _nibble_values(blocks[:, qs_start:], offset)
    return torch.mul(values, f16(blocks, 0)[:, :, None], out=out)


def _q4_0(blocks: torch.Tensor) -> torch.Tensor:
    return _scaled_nibbles(blocks, 2, 8).reshape(blocks.shape[0], 32)


def _q4_1(blocks: torch.Tensor) -> torch.Tensor:
    scaled = _scaled_nibbles(blocks, 4, 0)
    return scaled.add_(f16(blocks, 2)[:, :, None]).reshape(blocks.shape[0], 32)


def _q5_0(blocks: torch.Tensor) -> torch.Tensor:
    q = five_bit_quants(blocks, 2)
    return f16(blocks, 0) * (q.to(torch.int8) - 16).float()


def _q5_1(blocks: torch.Tensor) -> torch.Tensor:
    q = five_bit_quants(blocks, 4)
    return f16(blocks, 0) * q.float() + f16(blocks, 2)


def _q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float() * f16(blocks, 0)


def _k_quant(blocks: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Apply Q4_K/Q5_K sub-block scales and mins to `q` # [num_blocks, 256]."""
    scales, mins = k_scales_mins(blocks[:, 4:16])
    scale = (f16(blocks, 0) * scales.float()).unsqueeze(-1)  # [num_blocks, 8, 1]
    offset = (f16(blocks, 2) * mins.float()).unsqueeze(-1)
    return (scale * q.float().reshape(q.shape[0], 8, 32) - offset).reshape(q.shape[0], 256)


def _q4_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_quant(blocks, q4_k_quants(blocks))


def _q5_k(blocks: torch.Tensor) -> torch.Tensor:
    return _k_quant(blocks, q5_k_quants(blocks))


def _q6_k(blocks: torch.Tensor) -> torch.Tensor:
    num_blocks = blocks.shape[0]
    q = q6_k_quants(blocks).to(torch.int8) - 32
    scale = (f16(blocks, 208) * q6_k_scales(blocks)).unsqueeze(-1)  # [num_blocks, 16, 1]
    return (scale * q.float().reshape(num_blocks, 16, 16)).reshape(num_blocks, 256)


def _f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def _f16_plain(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def _bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


KERNELS: dict[GGMLQuantizationType, Kernel] = {
    GGMLQuantizationType.F32: _f32,
    GGMLQuantizationType.F16: _f16_plain,
    GGMLQuantizationType.BF16: _bf16,
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q5_0: _q5_0,
    GGMLQuantizationType.Q5_1: _q5_1,
    GGMLQuantizationType.Q8_0: _q8_0,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q5_K: _q5_k,
    GGMLQuantizationType.Q6_K: _q6_k,
}


def dequantize(
    raw: torch.Tensor, qtype: GGMLQuantizationType, shape: tuple[int, ...]
) -> torch.Tensor:
    """Dequantize the raw bytes of one GGML tensor to float32 of torch `shape` (row-major, the
    reverse of GGUF's dimension order), on `raw`'s device."""
    blocks = as_blocks(raw, qtype, shape)  # [num_blocks, block_bytes] uint8
    kernel = KERNELS.get(qtype)
    if kernel is None:
        reference = gguf_reference_dequantize(blocks.cpu().numpy(), qtype)
        weights = torch.from_numpy(np.ascontiguousarray(reference, np.float32))
        return weights.reshape(shape).to(raw.device)
    return kernel(blocks).reshape(shape)

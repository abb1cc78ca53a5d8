"""Reading the fields of GGML quantized blocks: float16 scales, packed nibbles and high bits,
the K-quants' 6-bit sub-block scales, and each type's unsigned integer quants.

Shared by `dequant` (blocks to float32) and `gguf_blocks` (blocks to `GroupQuantized`), so the
bit layouts (listed at the top of `dequant`) are written once. Every function takes blocks as
`[num_blocks, block_bytes]` uint8 on any device and loops over no block.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType


def as_blocks(raw: torch.Tensor, qtype: GGMLQuantizationType,
              shape: tuple[int, ...]) -> torch.Tensor:
    """The raw bytes of a `qtype` tensor of torch `shape` as its blocks, once their count is
    checked. # [num_bytes] uint8 -> [num_blocks, block_bytes] uint8"""
    block_numel, block_bytes = GGML_QUANT_SIZES[qtype]
    numel = int(np.prod(shape))
    if numel % block_numel != 0 or raw.numel() != numel // block_numel * block_bytes:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {numel // block_numel * block_bytes} "
            f"bytes in blocks of {block_numel}, got {raw.numel()} bytes"
        )
    return raw.reshape(-1, block_bytes)


def f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block, as float32. # [num_blocks, 1]"""
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def nibbles(packed: torch.Tensor, width: int) -> torch.Tensor:
    """Split each run of `width` bytes into its `width` low nibbles followed by its `width` high
    nibbles. # [num_blocks, num_bytes] uint8 -> [num_blocks, 2 * num_bytes] uint8"""
    runs = packed.reshape(packed.shape[0], -1, width)
    return torch.cat([runs & 0x0F, runs >> 4], dim=-1).reshape(packed.shape[0], -1)


def bits(packed: torch.Tensor) -> torch.Tensor:
    """Little-endian bits: bit j of the byte string is element j. # [n, b] -> [n, 8 * b]"""
    shifts = torch.arange(8, device=packed.device, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], -1)


def five_bit_quants(blocks: torch.Tensor, qh_start: int) -> torch.Tensor:
    """Q5_0/Q5_1's 32 unsigned 5-bit quants: 4 bytes of high bits at `qh_start`, then 16 bytes
    of nibbles. # [num_blocks, 32] uint8 in [0, 32)"""
    return nibbles(blocks[:, qh_start + 4 :], 16) | (bits(blocks[:, qh_start : qh_start + 4]) << 4)


def k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K block from its 12 packed bytes.

    Bytes 0-3 hold scales 0-3 (low 6 bits), bytes 4-7 mins 0-3; bytes 8-11 hold the low 4 bits of
    scale/min 4-7, whose top 2 bits sit in the spare top bits of bytes 0-3 / 4-7.
    """
    low_scales, low_mins, high = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = torch.cat([low_scales & 0x3F, (high & 0x0F) | ((low_scales >> 6) << 4)], dim=-1)
    mins = torch.cat([low_mins & 0x3F, (high >> 4) | ((low_mins >> 6) << 4)], dim=-1)
    return scales, mins  # [num_blocks, 8] uint8 each


def q4_k_quants(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K's 256 unsigned 4-bit quants. # [num_blocks, 256] uint8 in [0, 16)"""
    return nibbles(blocks[:, 16:], 32)


def q5_k_quants(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K's 256 unsigned 5-bit quants. # [num_blocks, 256] uint8 in [0, 32)"""
    # Bit 2c of qh[l] tops weight l of 64-chunk c; bit 2c+1 tops weight 32 + l.
    shifts = torch.arange(8, device=blocks.device, dtype=torch.uint8).view(1, 8, 1)
    high = ((blocks[:, 16:48].unsqueeze(1) >> shifts) & 1).reshape(blocks.shape[0], 256)
    return nibbles(blocks[:, 48:], 32) | (high << 4)


def q6_k_quants(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K's 256 unsigned 6-bit quants (the weight is quant - 32 times the sub-block scale).
    # [num_blocks, 256] uint8 in [0, 64)"""
    num_blocks = blocks.shape[0]
    low = nibbles(blocks[:, :128], 64)  # [num_blocks, 256]: 2 halves of 128
    # In half h, bits 2s..2s+1 of qh[32h + l] top weight 32s + l.
    shifts = torch.tensor([0, 2, 4, 6], device=blocks.device, dtype=torch.uint8).view(1, 1, 4, 1)
    high = (blocks[:, 128:192].reshape(num_blocks, 2, 1, 32) >> shifts) & 3
    return low | (high.reshape(num_blocks, 256) << 4)


def q6_k_scales(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K's 16 signed 8-bit sub-block scales, as float32. # [num_blocks, 16]"""
    return blocks[:, 192:208].contiguous().view(torch.int8).float()

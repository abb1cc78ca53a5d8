"""Per-block checksums: cheap evidence that a block arrived holding what its sender holds.

A block's checksum is CRC-32 (zlib) over its bytes in every region, codes then scales
(`kvpool.engine.kv_connector.regions`). CRC-32 runs at about 1 GB/s on one core and is made to
catch corrupted bytes; it is no defence against a peer that lies, and needs none: the peer is
the engine whose memory we read. The sender computes checksums on request (the side channel's
`checksums` message) over the blocks it offers; the receiver computes the same over its
destination blocks after the transfer and compares (`verify_blocks`).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from kvpool.engine.kv_connector.errors import KVTransferError


def block_checksums(tensors: Sequence[torch.Tensor], block_ids: Sequence[int]) -> list[int]:
    """The checksum of each block of `block_ids` over `tensors` (block-major, dim 0 = block)."""
    return [_checksum(tensors, block_id) for block_id in block_ids]


def verify_blocks(tensors: Sequence[torch.Tensor], pairs: Sequence[tuple[int, int]],
                  expected: Sequence[int]) -> None:
    """Check local blocks against the sender's checksums: `pairs` are (local block id, remote
    block id) and `expected[i]` the sender's checksum of `pairs[i]`'s remote block.
    KVTransferError (reason "checksum") naming every block that differs."""
    if len(expected) != len(pairs):
        raise ValueError(f"{len(expected)} checksums for {len(pairs)} blocks")
    actual = block_checksums(tensors, [local for local, _ in pairs])
    bad = [pair for pair, got, want in zip(pairs, actual, expected, strict=True) if got != want]
    if bad:
        raise KVTransferError("checksum", f"{len(bad)} of {len(pairs)} blocks differ from the "
                                          f"sender's (local, remote block ids): {bad}")


def _checksum(tensors: Sequence[torch.Tensor], block_id: int) -> int:
    crc = 0
    for tensor in tensors:
        block = tensor[block_id].detach().reshape(-1).view(torch.uint8).cpu()
        crc = zlib.crc32(block.numpy(), crc)
    return crc

"""Registered KV memory as the transport sees it: regions of bytes cut into equal blocks.

A region is one block-major tensor (dim 0 is the block id), so block b of a region is the
`bytes_per_block` contiguous bytes at `base_address + b * bytes_per_block`, and moving block b
between engines moves that range of every region. The plain KV cache
(`kvpool.memory.kv_cache.KVCache`) is one region (`[num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim]`), or two when its KV dtype is quantized (the scales,
`[num_blocks, num_layers, 2, block_size, num_kv_heads]`, indexed by the same block ids).

Only that plain, single-group layout is supported: a hybrid cache's groups
(`kvpool.memory.group_kv_cache`) are strided views whose rows overlap, not regions of this kind.

Invariants: a region's size is a whole number of blocks; regions are listed in a fixed order
(codes, then scales), the same on both sides of a transfer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from kvpool.memory.kv_cache import KVCache
    from kvpool.memory.kv_layout import KVLayout


@dataclass(frozen=True, slots=True)
class KVRegion:
    """One registered block-major tensor: where it starts, how big it is, how big a block is."""

    base_address: int
    num_bytes: int
    bytes_per_block: int

    def __post_init__(self) -> None:
        if self.bytes_per_block < 1 or self.num_bytes % self.bytes_per_block:
            raise ValueError(f"a region of {self.num_bytes} bytes is not a whole number of "
                             f"{self.bytes_per_block}-byte blocks")

    @property
    def num_blocks(self) -> int:
        return self.num_bytes // self.bytes_per_block

    def block_address(self, block_id: int) -> int:
        """The address of block `block_id`'s first byte; ValueError outside the region."""
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside a region of {self.num_blocks} "
                             f"blocks")
        return self.base_address + block_id * self.bytes_per_block


def kv_tensors(cache: KVCache) -> tuple[torch.Tensor, ...]:
    """The tensors that hold a plain KV cache's blocks, in region order: codes, then scales if
    quantized. ValueError for a cache of several groups (hybrid models)."""
    if len(cache.group_layouts) != 1:
        raise ValueError(f"the KV transport supports the plain single-group KV cache; this one "
                         f"has {len(cache.group_layouts)} groups")
    return (cache.tensor,) if cache.scales is None else (cache.tensor, cache.scales)


def region_block_bytes(layout: KVLayout) -> tuple[int, ...]:
    """Bytes per block of each region a plain KV cache of `layout` registers, in
    `kv_tensors` order."""
    if layout.is_quantized:
        return (layout.kv_bytes_per_block, layout.scale_bytes_per_block)
    return (layout.kv_bytes_per_block,)


def regions_of(tensors: Sequence[torch.Tensor]) -> tuple[KVRegion, ...]:
    """Each block-major tensor as a region; ValueError for one that is not contiguous."""
    regions = []
    for tensor in tensors:
        if not tensor.is_contiguous() or tensor.dim() == 0 or tensor.shape[0] == 0:
            raise ValueError(f"a KV region must be a contiguous tensor of at least one block; "
                             f"got shape {tuple(tensor.shape)}, strides {tensor.stride()}")
        num_bytes = tensor.numel() * tensor.element_size()
        regions.append(KVRegion(tensor.data_ptr(), num_bytes, num_bytes // tensor.shape[0]))
    return tuple(regions)


def block_ranges(local: Sequence[KVRegion], remote: Sequence[KVRegion],
                 pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(local address, remote address, length) of every byte range that moves the blocks of
    `pairs` (local block id, remote block id), region by region. Pairs are taken in local id
    order, and a run of pairs consecutive on both sides becomes one range: a prompt's blocks
    are often consecutive, and one large request costs less than many small ones.
    ValueError for a block id outside its region, or regions that do not match."""
    if [r.bytes_per_block for r in local] != [r.bytes_per_block for r in remote]:
        raise ValueError(f"local regions of {[r.bytes_per_block for r in local]} bytes per "
                         f"block cannot exchange blocks with remote regions of "
                         f"{[r.bytes_per_block for r in remote]}")
    runs = _runs(sorted(pairs))
    ranges = []
    for local_region, remote_region in zip(local, remote, strict=True):
        for local_id, remote_id, num_blocks in runs:
            local_region.block_address(local_id + num_blocks - 1)  # range checks
            remote_region.block_address(remote_id + num_blocks - 1)
            ranges.append((local_region.block_address(local_id),
                           remote_region.block_address(remote_id),
                           num_blocks * local_region.bytes_per_block))
    return ranges


def _runs(pairs: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(first local id, first remote id, length) of each run of pairs consecutive on both
    sides, for pairs sorted by local id."""
    runs: list[tuple[int, int, int]] = []
    for local_id, remote_id in pairs:
        if runs:
            first_local, first_remote, length = runs[-1]
            if (local_id, remote_id) == (first_local + length, first_remote + length):
                runs[-1] = (first_local, first_remote, length + 1)
                continue
        runs.append((local_id, remote_id, 1))
    return runs

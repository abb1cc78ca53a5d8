"""The KV cache tensor: every block's K and V for every layer, in one preallocated tensor.

Layout, block-major:

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        block b ─┬─ layer 0 ─┬─ K: [block_size, num_kv_heads, head_dim]
                 │           └─ V: [block_size, num_kv_heads, head_dim]
                 ├─ layer 1 ─ ...
                 └─ layer L-1

Why block-major: all of a block's KV (K next to V, every layer) is one contiguous byte range,
so a copy-on-write copy, a migration between pool segments, or a swap to host memory moves a
block in one contiguous copy, and a run of block ids is a run of bytes that an arena can hand
out as a segment. A layer's view `kv[:, layer]` is strided across blocks, which gathers and
kernels index without cost.

Invariant: the tensor never changes shape or storage after construction; block ids index dim 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.memory.block_table import BlockCopy

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def kv_bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """Bytes of one block: K and V for every layer."""
    element_size = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * element_size


class KVCache:
    """One `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` tensor."""

    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        storage: torch.Tensor | None = None,
    ) -> None:
        """Allocate the cache, or lay it over `storage` (a byte buffer, e.g. an arena range)."""
        if dtype not in KV_DTYPES.values():
            raise ValueError(f"KV dtype must be one of {sorted(KV_DTYPES)}, got {dtype}")
        shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
        if storage is None:
            self.tensor = torch.zeros(shape, dtype=dtype, device=device)
        else:
            needed = num_blocks * kv_bytes_per_block(
                num_layers, block_size, num_kv_heads, head_dim, dtype
            )
            if storage.dtype != torch.uint8 or storage.numel() < needed:
                raise ValueError(f"storage must be a uint8 buffer of at least {needed} bytes")
            self.tensor = storage[:needed].view(dtype).view(shape)
        self.num_blocks = num_blocks
        self.num_layers = num_layers
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype

    @property
    def bytes_per_block(self) -> int:
        return kv_bytes_per_block(
            self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype
        )

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def layer(self, layer_index: int) -> torch.Tensor:
        """`[num_blocks, 2, block_size, num_kv_heads, head_dim]` view of one layer."""
        return self.tensor[:, layer_index]

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Copy whole blocks (every layer, K and V) src → dst in one vectorised call.

        Sources are read before any destination is written, so chains like a→b, b→c are safe.
        """
        if not copies:
            return
        device = self.tensor.device
        src = torch.tensor([copy.src_block_id for copy in copies], dtype=torch.int64, device=device)
        dst = torch.tensor([copy.dst_block_id for copy in copies], dtype=torch.int64, device=device)
        self.tensor[dst] = self.tensor[src]


def write_kv(
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Scatter the new tokens' K and V into their slots (one indexed write each)."""
    block_size = kv_cache_layer.shape[2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    kv_cache_layer[block_ids, 0, offsets] = key.to(kv_cache_layer.dtype)
    kv_cache_layer[block_ids, 1, offsets] = value.to(kv_cache_layer.dtype)


def num_blocks_for_memory(memory_bytes: int, bytes_per_block: int) -> int:
    """How many whole blocks a memory budget holds."""
    if memory_bytes < bytes_per_block:
        raise ValueError(
            f"a KV budget of {memory_bytes} bytes cannot hold one block ({bytes_per_block} bytes)"
        )
    return memory_bytes // bytes_per_block

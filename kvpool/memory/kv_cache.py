"""The KV cache tensor: every block's K and V for every layer, in one preallocated tensor.

Layout, block-major (`KVLayout.tensor_shape`):

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

Quantized layouts (int8, fp8: `kvpool.memory.kv_quant`) add a second tensor, the scale pool,
indexed by the same block ids and allocated with the codes:

    scales[num_blocks, num_layers, 2, block_size, num_kv_heads]   float32

Row (block, layer, K or V, slot, KV head) is the scale of that token's code row. Whatever moves
a block's codes moves its scales (`copy_blocks`, so copy-on-write and elastic migration).

Invariants: the tensors never change shape or storage after construction; block ids index
dim 0 of both; shapes and dtypes are the layout's (asserted once, here); block 0, the null block
(`kvpool.memory.block_pool.NULL_BLOCK_ID`), is zero and is never written; `scales` is None
exactly when the layout is not quantized.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.pinned import pinned_zeros


class KVCache:
    """One `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]` tensor, the null
    block included in `num_blocks`."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        storage: torch.Tensor | None = None,
        pin_memory: bool = False,
    ) -> None:
        """Allocate the cache (zeroed; page-locked host memory of exactly its size with
        `pin_memory`, for asynchronous copies to and from CUDA: `kvpool.memory.pinned`), or
        lay it over `storage` (a byte buffer, e.g. an
        arena range; only the null block is zeroed then)."""
        shape = layout.tensor_shape(num_blocks)
        zeros = _pinned_or_plain_zeros(device, pin_memory)
        if storage is None:
            self.tensor = zeros(shape, layout.torch_dtype)
        else:
            needed = num_blocks * layout.kv_bytes_per_block
            if storage.dtype != torch.uint8 or storage.numel() < needed:
                raise ValueError(f"storage must be a uint8 buffer of at least {needed} bytes")
            self.tensor = storage[:needed].view(layout.torch_dtype).view(shape)
            self.tensor[NULL_BLOCK_ID].zero_()
        self.scales: torch.Tensor | None = None
        if layout.is_quantized:  # ones, not zeros: a never-written row decodes to 0 * 1
            self.scales = zeros(layout.scale_tensor_shape(num_blocks), torch.float32).fill_(1.0)
        layout.check_tensor(self.tensor)
        layout.check_scales(self.scales, num_blocks)
        self.layout = layout
        # What a step hands the model (`kvpool.attention.kv_step`): one group of every layer.
        self.group_layouts = (layout,)
        self.layer_groups = (0,) * layout.num_layers
        self.layer_views = tuple(self.layer(i) for i in range(layout.num_layers))
        self.scale_views = tuple(self.layer_scales(i) for i in range(layout.num_layers))

    @property
    def num_blocks(self) -> int:
        return self.tensor.shape[0]

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    def layer(self, layer_index: int) -> torch.Tensor:
        """`[num_blocks, 2, block_size, num_kv_heads, head_dim]` view of one layer."""
        return self.tensor[:, layer_index]

    def layer_scales(self, layer_index: int) -> torch.Tensor | None:
        """`[num_blocks, 2, block_size, num_kv_heads]` view of one layer's scales, or None."""
        return None if self.scales is None else self.scales[:, layer_index]

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
        if self.scales is not None:
            self.scales[dst] = self.scales[src]


def _pinned_or_plain_zeros(device: torch.device | str, pin_memory: bool):
    """`zeros(shape, dtype)` on `device`; page-locked host memory with `pin_memory`."""
    if pin_memory:
        assert torch.device(device).type == "cpu", "only host memory is pinned"
        return pinned_zeros
    return lambda shape, dtype: torch.zeros(shape, dtype=dtype, device=device)

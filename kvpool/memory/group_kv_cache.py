"""Every KV cache group's KV over one byte buffer: the tensors of a hybrid pool.

The hybrid pool (`kvpool.memory.hybrid_pool`) hands group g pages of `page_g` bytes at offsets
that are whole multiples of its `unit`, and names page b by `b = offset / unit`. So group g's
KV is one strided view of the buffer, indexed by those ids directly (the views need only the
groups, the unit and the buffer: a tensor-parallel worker builds the same over its own):

    kv_g[num_rows_g, L_g, 2, block_size, num_kv_heads, head_dim]
      stride of dim 0 = unit bytes (rows overlap: only ids the pool handed out are used)
      row b = bytes b * unit .. b * unit + page_g, block-major as in `kvpool.memory.kv_cache`

Layer i of the model is `kv_g[:, j]`, j its index within its group; the attention kernels take
any dim-0 stride. Row 0 of every group is the null page (the first max-page bytes, zero).

Invariants: views never change; the buffer starts zeroed and the null page stays zero; a copy
moves a block within its group. Quantized KV (int8 / fp8 scales) is not laid out here: the
engine keeps one group for it (`kvpool.engine.setup`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_groups import KVGroup, page_rows
from kvpool.memory.kv_layout import KVLayout


@dataclass(frozen=True, slots=True)
class GroupKV:
    """One group's KV as a cache the tiers copy blocks of (`KVCache`'s `tensor` and `scales`):
    row b is the group's block b."""

    tensor: torch.Tensor
    scales: None = None


class GroupedKVCache:
    """Views over `buffer` (the hybrid pool's reservation: `HybridBlockPool.arena`'s bytes)
    for `groups`, whose pages start at whole multiples of `unit` bytes."""

    def __init__(self, groups: Sequence[KVGroup], unit: int, buffer: torch.Tensor) -> None:
        self.groups = tuple(groups)
        self.unit = unit
        self.group_layouts: tuple[KVLayout, ...] = tuple(g.layout for g in self.groups)
        if any(layout.is_quantized for layout in self.group_layouts):
            raise ValueError("grouped KV does not hold int8 / fp8 scales")
        # Zeroed once, the null page and every other: attention weighs a block's unwritten
        # slots by 0, and 0 times stale bytes read as NaN would still be NaN.
        buffer.zero_()
        self.buffer = buffer
        self.tensors = tuple(self._view(group) for group in range(len(self.groups)))
        num_layers = sum(len(group.layers) for group in self.groups)
        layer_groups, layer_views = [0] * num_layers, [None] * num_layers
        for index, group in enumerate(self.groups):
            for position, layer in enumerate(group.layers):
                layer_groups[layer] = index
                layer_views[layer] = self.tensors[index][:, position]
        self.layer_groups = tuple(layer_groups)
        self.layer_views = tuple(layer_views)
        self.scale_views = (None,) * num_layers
        self.tensor = self.tensors[0]  # the first group's: what one-group code reads
        self.scales = None
        self.group_caches = tuple(GroupKV(tensor) for tensor in self.tensors)

    def _view(self, group: int) -> torch.Tensor:
        layout, unit = self.group_layouts[group], self.unit
        element = layout.element_size
        assert unit % element == 0, "a page must start on an element"
        typed = self.buffer.view(layout.torch_dtype)
        block = layout.block_shape  # [L_g, 2, block_size, heads, head_dim]
        strides, stride = [], 1
        for size in reversed(block):
            strides.insert(0, stride)
            stride *= size
        num_rows = page_rows(self.nbytes, layout.bytes_per_block, unit)
        return typed.as_strided((num_rows, *block), (unit // element, *strides))

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Whole-block copies, each within its group (sources read before any write)."""
        for group, tensor in enumerate(self.tensors):
            pairs = [(c.src_block_id, c.dst_block_id) for c in copies if c.group == group]
            if pairs:
                src, dst = (torch.tensor(ids, dtype=torch.int64, device=tensor.device)
                            for ids in zip(*pairs, strict=True))
                tensor[dst] = tensor[src]

    def check_null_page(self) -> None:
        for group, tensor in enumerate(self.tensors):
            assert not tensor[0].any(), f"group {group} wrote the null page"

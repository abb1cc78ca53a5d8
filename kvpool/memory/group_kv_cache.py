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

Quantized KV (int8 / fp8) puts each page's float32 scales after its codes:

    page b of group g = codes [L_g, 2, block_size, H, D] | scales [L_g, 2, block_size, H]

so the scales are a second strided view (offset by the codes' bytes), and a page is one range
of bytes whatever it holds: moved, copied or spilled whole.

Invariants: views never change; the buffer starts zeroed and the null page stays zero; a copy
moves a block within its group; every code and scale a kernel may read is finite (`clear_pages`
for pages that come from another group).
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
    scales: torch.Tensor | None = None


class GroupedKVCache:
    """Views over `buffer` (the hybrid pool's reservation: `HybridBlockPool.arena`'s bytes)
    for `groups`, whose pages start at whole multiples of `unit` bytes."""

    def __init__(self, groups: Sequence[KVGroup], unit: int, buffer: torch.Tensor) -> None:
        self.groups = tuple(groups)
        self.unit = unit
        self.group_layouts: tuple[KVLayout, ...] = tuple(g.layout for g in self.groups)
        # Zeroed once, the null page and every other: attention weighs a block's unwritten
        # slots by 0, and 0 times stale bytes read as NaN would still be NaN.
        buffer.zero_()
        self.buffer = buffer
        self.tensors = tuple(self._codes(group) for group in range(len(self.groups)))
        self.scale_tensors = tuple(self._scales(group) for group in range(len(self.groups)))
        num_layers = sum(len(group.layers) for group in self.groups)
        layer_groups, layer_views = [0] * num_layers, [None] * num_layers
        scale_views: list[torch.Tensor | None] = [None] * num_layers
        for index, group in enumerate(self.groups):
            scales = self.scale_tensors[index]
            for position, layer in enumerate(group.layers):
                layer_groups[layer] = index
                layer_views[layer] = self.tensors[index][:, position]
                scale_views[layer] = None if scales is None else scales[:, position]
        self.layer_groups = tuple(layer_groups)
        self.layer_views = tuple(layer_views)
        self.scale_views = tuple(scale_views)
        self.tensor = self.tensors[0]  # the first group's: what one-group code reads
        self.scales = self.scale_tensors[0]
        self.group_caches = tuple(GroupKV(tensor, scales) for tensor, scales
                                  in zip(self.tensors, self.scale_tensors, strict=True))

    def _codes(self, group: int) -> torch.Tensor:
        """Group `group`'s K/V (codes, for int8 / fp8): the first bytes of each page."""
        layout = self.group_layouts[group]
        return self._strided(group, layout.torch_dtype, layout.block_shape, 0)

    def _scales(self, group: int) -> torch.Tensor | None:
        """Group `group`'s float32 scales (int8 / fp8 only): each page's last bytes, after its
        codes."""
        layout = self.group_layouts[group]
        if not layout.is_quantized:
            return None
        return self._strided(group, torch.float32, layout.scale_block_shape,
                             layout.kv_bytes_per_block)

    def _strided(self, group: int, dtype: torch.dtype, block: Sequence[int],
                 offset: int) -> torch.Tensor:
        """`[num_rows, *block]` of `dtype`, row b at byte b * unit + `offset`, each row
        contiguous (`block` is the page's part: codes, or scales)."""
        element = torch.empty((), dtype=dtype).element_size()
        assert self.unit % element == 0 and offset % element == 0, "parts start on an element"
        strides, stride = [], 1
        for size in reversed(block):
            strides.insert(0, stride)
            stride *= size
        num_rows = page_rows(self.nbytes, self.groups[group].page_bytes, self.unit)
        return self.buffer.view(dtype).as_strided((num_rows, *block),
                                                  (self.unit // element, *strides),
                                                  offset // element)

    def clear_pages(self, pages: Sequence[tuple[int, int]]) -> None:
        """Zero `pages` ((group, block id) pairs: pages a group took from the arena since the
        last step) of a quantized cache. Their bytes may be another group's: read as float32
        scales or fp8 codes they could be NaN, and a gather of a block's unwritten slots would
        carry it (0 times NaN). Float KV needs nothing: a group reads another's floats as
        floats (pages start on an element), and int8 codes are any bytes."""
        for group, scales in enumerate(self.scale_tensors):
            ids = [block_id for page_group, block_id in pages if page_group == group]
            if scales is not None and ids:
                index = torch.tensor(ids, dtype=torch.int64, device=scales.device)
                self.tensors[group][index] = 0
                scales[index] = 0.0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def copy_blocks(self, copies: Sequence[BlockCopy]) -> None:
        """Whole-block copies (codes and scales), each within its group (sources read before
        any write)."""
        for group, (tensor, scales) in enumerate(zip(self.tensors, self.scale_tensors,
                                                     strict=True)):
            pairs = [(c.src_block_id, c.dst_block_id) for c in copies if c.group == group]
            if pairs:
                src, dst = (torch.tensor(ids, dtype=torch.int64, device=tensor.device)
                            for ids in zip(*pairs, strict=True))
                tensor[dst] = tensor[src]
                if scales is not None:
                    scales[dst] = scales[src]

    def check_null_page(self) -> None:
        for group, tensor in enumerate(self.tensors):
            assert not tensor[0].any(), f"group {group} wrote the null page"

"""The interface between the model and a paged-attention implementation.

The model calls a backend once per layer with that layer's view of the KV cache and the step's
`AttentionMetadata`; nothing reaches the backend through globals.

KV cache layout (see `kvpool.memory.kv_cache`): the whole cache is one tensor
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, block-major so that all of a
block's K and V (every layer) are one contiguous range: copy-on-write, migration between arena
segments and swapping to host each move a block in one contiguous copy. A layer's view,
`kv_cache[:, layer]`, is `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
(index 0 of dim 1 is K, index 1 is V), strided across blocks.

Quantized KV (`kv_cache_dtype` int8 / fp8, `kvpool.memory.kv_quant`): the layer view holds
codes, and `kv_scales` is the layer's view of the scale pool, `[num_blocks, 2, block_size,
num_kv_heads]` float32 (one scale per token and KV head, K and V apart). A backend quantizes
as it writes and dequantizes as it reads (`row = code * scale`); `kv_scales` is None for a
float cache.
"""

from __future__ import annotations

from typing import Protocol

import torch

from kvpool.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    """Paged attention: write the step's new K/V into their slots, then attend through the
    block tables."""

    name: str

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads]
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...

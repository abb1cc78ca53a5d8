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

Sliding-window attention (Mistral, Gemma 2 / 3 sliding layers): `sliding_window=W` limits each
new token to the W most recent positions, itself included. The token at absolute position p
attends to key position k exactly when `p - W < k <= p`, which is transformers' convention
(`masking_utils.sliding_window_overlay`: `kv_idx > q_idx - sliding_window`, and the flash path's
`window_size=(W - 1, W - 1)`, in transformers 5.x). `None` is full causal attention, and so is
any W at least the context length. The window is a property of the layer, constant over a run;
every block stays allocated (freeing the blocks that fall out of the window is not done here).

Attention logit soft-capping (Gemma 2; `attn_logit_softcapping` in its config.json):
`logit_softcap=c` replaces each scaled score s = scale * q.k by `c * tanh(s / c)` before the
mask and the softmax, as transformers' eager Gemma 2 attention does, so no score exceeds c in
magnitude. `None` leaves scores as they are. Like the window it is a property of the model,
constant over a run, and it composes with the window and with quantized KV.
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
        sliding_window: int | None = None,  # the layer's window in tokens; None: full
        logit_softcap: float | None = None,  # scores -> cap * tanh(score / cap); None: off
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...


def check_sliding_window(sliding_window: int | None) -> None:
    """Raise `ValueError` unless the window is None or a positive number of tokens."""
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be None or >= 1, got {sliding_window}")


def check_logit_softcap(logit_softcap: float | None) -> None:
    """Raise `ValueError` unless the soft-cap is None or a positive number."""
    if logit_softcap is not None and not logit_softcap > 0:
        raise ValueError(f"logit_softcap must be None or > 0, got {logit_softcap}")

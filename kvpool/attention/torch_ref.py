"""Paged attention in plain PyTorch: the numerical reference every faster backend is tested
against, and the CPU backend.

Each call first scatters the step's new K/V into their slots, then attends through the block
tables:

- decode sequences (query_len 1, the first `num_decode_seqs`) are batched: their blocks are
  gathered into one zero-padded `[num_decode, max_context, ...]` tensor and a single
  `scaled_dot_product_attention` call runs with a padding mask;
- prefill / extend sequences (query_len > 1) run one SDPA call each, because their query and
  context lengths differ widely and padding them together wastes more than the loop costs.

Grouped-query attention never repeats K/V: the `group_size = num_heads // num_kv_heads` query
heads that share a KV head are folded into the query-length dimension, so SDPA sees
`[num_kv_heads, group_size * query_len, head_dim]` against `[num_kv_heads, context, head_dim]`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kvpool.attention.metadata import AttentionMetadata
from kvpool.memory.kv_cache import write_kv


def gather_context(
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, num_blocks_per_seq] int
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each sequence's blocks laid end to end: two
    `[num_seqs, num_kv_heads, num_blocks_per_seq * block_size, head_dim]` views.

    One `index_select` over a `[2, num_kv_heads, num_blocks, block_size, head_dim]` view of the
    cache gathers straight into the layout attention reads, so no second copy is needed; with a
    workspace it lands in a reused buffer instead of fresh pages.
    """
    num_seqs, num_blocks_per_seq = block_tables.shape
    _, _, block_size, num_kv_heads, head_dim = kv_cache_layer.shape
    source = kv_cache_layer.permute(1, 3, 0, 2, 4)  # [2, Hkv, num_blocks, block_size, D]
    block_ids = block_tables.reshape(-1).long()
    shape = (2, num_kv_heads, block_ids.numel(), block_size, head_dim)
    if workspace is None:
        gathered = source.index_select(2, block_ids)
    else:
        gathered = workspace.take(shape, kv_cache_layer.dtype, kv_cache_layer.device)
        torch.index_select(source, 2, block_ids, out=gathered)
    context = gathered.view(2, num_kv_heads, num_seqs, num_blocks_per_seq * block_size, head_dim)
    context = context.transpose(1, 2)  # [2, num_seqs, Hkv, context, D], a view
    return context[0], context[1]


class Workspace:
    """One scratch buffer reused by every gather, grown when a step needs more.

    Large fresh tensors cost a page fault per 4 KiB page on first touch: on the CPU that made a
    decode step's gathers about 4x slower than writing into memory that is already mapped.
    A gather's result is dead before the next gather (one layer at a time), so one buffer serves
    all layers and steps.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffer
        if (
            buffer is None
            or buffer.dtype != dtype
            or buffer.device != device
            or buffer.numel() < numel
        ):
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffer = buffer
        return buffer[:numel].view(shape)


class TorchAttentionBackend:
    """The `AttentionBackend` reference implementation (any device, any float dtype)."""

    name = "torch"

    def __init__(self) -> None:
        self.workspace = Workspace()

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        write_kv(kv_cache_layer, key, value, metadata.slot_mapping)
        output = torch.empty_like(query)
        num_decode = metadata.num_decode_seqs
        if num_decode:
            output[:num_decode] = self._decode(query[:num_decode], kv_cache_layer, metadata, scale)
        starts = metadata.query_start_loc.tolist()
        for seq_index in range(num_decode, metadata.num_seqs):
            self._prefill_one(
                query, output, kv_cache_layer, metadata, seq_index, starts[seq_index], scale
            )
        return output

    def _decode(
        self,
        query: torch.Tensor,  # [num_decode, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_decode, num_heads, head_dim = query.shape
        block_size = metadata.block_size
        seq_lens = metadata.seq_lens_cpu[:num_decode]
        num_blocks = -(-max(seq_lens) // block_size)
        keys, values = gather_context(
            kv_cache_layer, metadata.block_tables[:num_decode, :num_blocks], self.workspace
        )
        num_kv_heads = keys.shape[1]
        positions = torch.arange(num_blocks * block_size, device=query.device)
        # [num_decode, 1, 1, context]: True where the position holds one of the sequence's tokens
        is_valid = positions[None, :] < metadata.seq_lens[:num_decode, None]
        grouped_query = query.view(num_decode, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped_query,
            keys.to(query.dtype),
            values.to(query.dtype),
            attn_mask=is_valid[:, None, None, :],
            scale=scale,
        )
        return out.reshape(num_decode, num_heads, head_dim)

    def _prefill_one(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
        seq_index: int,
        start: int,
        scale: float,
    ) -> None:
        query_len = metadata.query_lens_cpu[seq_index]
        seq_len = metadata.seq_lens_cpu[seq_index]
        num_blocks = -(-seq_len // metadata.block_size)
        table = metadata.block_tables[seq_index : seq_index + 1, :num_blocks]
        keys, values = gather_context(
            kv_cache_layer, table, self.workspace
        )  # [1, Hkv, >=seq_len, D]
        keys, values = keys[0, :, :seq_len].to(query.dtype), values[0, :, :seq_len].to(query.dtype)
        num_kv_heads, head_dim = keys.shape[0], keys.shape[2]
        group_size = query.shape[1] // num_kv_heads
        # [Hkv, group_size * query_len, D]: query heads of a group folded into the length dim
        seq_query = query[start : start + query_len].view(
            query_len, num_kv_heads, group_size, head_dim
        )
        seq_query = seq_query.permute(1, 2, 0, 3).reshape(
            num_kv_heads, group_size * query_len, head_dim
        )
        query_positions = torch.arange(seq_len - query_len, seq_len, device=query.device)
        is_visible = torch.arange(seq_len, device=query.device)[None, :] <= query_positions[:, None]
        mask = is_visible.repeat(group_size, 1)  # [group_size * query_len, seq_len]
        out = F.scaled_dot_product_attention(seq_query, keys, values, attn_mask=mask, scale=scale)
        out = out.view(num_kv_heads, group_size, query_len, head_dim).permute(2, 0, 1, 3)
        output[start : start + query_len] = out.reshape(query_len, -1, head_dim)

"""Paged attention in plain PyTorch: the numerical reference every faster backend is tested
against, and the CPU backend.

Each call first scatters the step's new K/V into their slots, then attends through the block
tables:

- decode sequences (query_len 1, the first `num_decode_seqs`) are batched: sequences of similar
  context length are grouped, each group's blocks are gathered into one padded
  `[group_size, max_context, ...]` tensor and one `scaled_dot_product_attention` call per group
  runs with a padding mask;
- prefill / extend sequences (query_len > 1) run one SDPA call each, because their query and
  context lengths differ widely and padding them together wastes more than the loop costs.

Grouped-query attention never repeats K/V in decode: the `group_size = num_heads //
num_kv_heads` query heads that share a KV head are folded into the query-length dimension, so
SDPA sees `[num_kv_heads, group_size, head_dim]` against `[num_kv_heads, context, head_dim]`.
Prefill keeps the `[1, num_heads, query_len, head_dim]` shape with `enable_gqa`, because that
is the shape PyTorch's fused (flash) CPU kernel takes: the folded one fell back to the unfused
math path, about 4.5x slower for a 512-token prompt.

Sliding window (`sliding_window=W`, `kvpool.attention.backend`): a decode gathers only the
blocks that hold its window (its block table read from the window's first block on) and masks
the positions before the window; a prefill gathers from the first block any of its tokens sees
and masks both sides of each token's window. W at least the context takes the full paths.

Soft-capped scores (`logit_softcap=c`, `kvpool.attention.backend`): SDPA cannot cap its scores,
so a capped call computes them explicitly (`softcapped_attention`: scores, `c * tanh(s / c)`,
mask, softmax in float32, weighted sum), over the same gathered context and masks. The uncapped
path is the SDPA one, untouched.

Quantized KV (int8 / fp8 codes with `kv_scales`): the write (`kvpool.attention.kv_write`)
quantizes each row, and the gather dequantizes the gathered copy of the codes
into the query's dtype (`code * scale`). Being the reference, it may: the kernels dequantize in
registers instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.torch_version import TorchVersion

from kvpool.attention.backend import check_logit_softcap, check_sliding_window
from kvpool.attention.kv_write import write_kv
from kvpool.attention.metadata import AttentionMetadata
from kvpool.memory.kv_quant import dequantize

# `enable_gqa` arrived in PyTorch 2.5; older versions get K/V repeated per query head instead.
SDPA_HAS_GQA = TorchVersion(torch.__version__) >= "2.5"


def grouped_query_sdpa(
    query: torch.Tensor,  # [batch, num_heads, query_len, head_dim]
    keys: torch.Tensor,  # [batch, num_kv_heads, context, head_dim]
    values: torch.Tensor,
    **sdpa_options: Any,
) -> torch.Tensor:  # [batch, num_heads, query_len, head_dim]
    """`scaled_dot_product_attention` with fewer KV heads than query heads."""
    if SDPA_HAS_GQA:
        return F.scaled_dot_product_attention(query, keys, values, enable_gqa=True, **sdpa_options)
    group_size = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group_size, 1), values.repeat_interleave(group_size, 1)
    return F.scaled_dot_product_attention(query, keys, values, **sdpa_options)


def softcapped_attention(
    query: torch.Tensor,  # [batch, num_heads, query_len, head_dim]
    keys: torch.Tensor,  # [batch, num_kv_heads, context, head_dim]
    values: torch.Tensor,
    mask: torch.Tensor | None,  # bool, broadcast to [batch, num_heads, query_len, context]
    scale: float,
    logit_softcap: float,
) -> torch.Tensor:  # [batch, num_heads, query_len, head_dim]
    """Attention with each score s soft-capped to `c * tanh(s / c)` before the mask (True:
    attended) and the softmax, which run in float32; what SDPA would do, plus the cap."""
    group_size = query.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group_size, 1) if group_size > 1 else keys
    values = values.repeat_interleave(group_size, 1) if group_size > 1 else values
    scores = torch.matmul(query, keys.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / logit_softcap) * logit_softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(values.dtype), values)


def gather_context(
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, num_blocks_per_seq] int
    workspace: Workspace | None = None,
    kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads]
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of each sequence's blocks laid end to end: two
    `[num_seqs, num_kv_heads, num_blocks_per_seq * block_size, head_dim]` views.

    One `index_select` over a `[2, num_kv_heads, num_blocks, block_size, head_dim]` view of the
    cache gathers straight into the layout attention reads, so no second copy is needed; with a
    workspace it lands in a reused buffer instead of fresh pages. With `kv_scales` the gathered
    codes are dequantized into `dtype`, a new tensor.
    """
    keys, values = _gather_codes(kv_cache_layer, block_tables, workspace)
    if kv_scales is None:
        return keys, values
    num_seqs = block_tables.shape[0]
    block_ids = block_tables.reshape(-1).long()
    scales = kv_scales.permute(1, 3, 0, 2).index_select(2, block_ids)  # [2, Hkv, n, block_size]
    scales = scales.reshape(2, scales.shape[1], num_seqs, -1).transpose(1, 2)
    assert dtype is not None, "dequantizing needs the dtype to dequantize into"
    return dequantize(keys, scales[0], dtype), dequantize(values, scales[1], dtype)


def _gather_codes(
    kv_cache_layer: torch.Tensor, block_tables: torch.Tensor, workspace: Workspace | None
) -> tuple[torch.Tensor, torch.Tensor]:
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


@dataclass(frozen=True)
class DecodeGroup:
    """Decode sequences of similar context length, padded together to the longest of them.

    Row i's gathered context starts at the block its window starts in, b_i (0 without a
    sliding window), so column j of `is_valid` is position `b_i * block_size + j`."""

    rows: torch.Tensor  # [group_size] int64: the sequences' rows among the decodes
    block_tables: torch.Tensor  # [group_size, num_blocks] int: from each row's first block
    is_valid: torch.Tensor  # [group_size, 1, 1, num_blocks * block_size] bool: attended positions


# A group's padded context may exceed its real context by this factor (plus one block per
# sequence) before a new group starts: each group costs a few small ops per layer, padding
# costs gather and attention work in proportion.
MAX_PADDING_FACTOR = 1.25
MAX_DECODE_GROUPS = 8


def window_first_block(seq_len: int, sliding_window: int | None, block_size: int) -> int:
    """The first block a decode at context `seq_len` attends to: 0 without a window."""
    if sliding_window is None:
        return 0
    return max(0, seq_len - sliding_window) // block_size


def plan_decode_groups(
    metadata: AttentionMetadata, sliding_window: int | None = None
) -> list[DecodeGroup]:
    """Split the decode sequences into groups of similar gathered length (longest first); with
    a window, each sequence gathers only the blocks from its window's first one."""
    num_decode, layout = metadata.num_decode_seqs, metadata.layout
    block_size = layout.block_size
    seq_lens = metadata.seq_lens_cpu[:num_decode]
    spans = [  # tokens gathered per sequence: from its first block to its end
        seq_len - window_first_block(seq_len, sliding_window, block_size) * block_size
        for seq_len in seq_lens
    ]
    order = sorted(range(num_decode), key=lambda row: spans[row], reverse=True)
    memberships: list[list[int]] = [[]]
    for row in order:
        members = memberships[-1]
        longest = spans[members[0]] if members else spans[row]
        padded = (len(members) + 1) * layout.num_blocks_for_tokens(longest) * block_size
        real = sum(spans[m] for m in members) + spans[row] + block_size * (len(members) + 1)
        if members and padded > MAX_PADDING_FACTOR * real and len(memberships) < MAX_DECODE_GROUPS:
            memberships.append([])
        memberships[-1].append(row)
    if len(memberships) == 1:  # keep the caller's row order: no gather of rows needed
        memberships = [list(range(num_decode))]
    # Contexts no longer than the window need no window mask: the plain path serves them.
    is_windowed = sliding_window is not None and max(seq_lens, default=0) > sliding_window
    return [
        _decode_group(metadata, members, max(spans[m] for m in members),
                      sliding_window if is_windowed else None)
        for members in memberships
    ]


def _decode_group(
    metadata: AttentionMetadata, members: list[int], longest: int, sliding_window: int | None
) -> DecodeGroup:
    layout, device = metadata.layout, metadata.block_tables.device
    rows = torch.tensor(members, dtype=torch.int64, device=device)
    num_blocks = layout.num_blocks_for_tokens(longest)
    positions = torch.arange(num_blocks * layout.block_size, device=device)[None, :]
    seq_lens = metadata.seq_lens[rows, None]
    if sliding_window is None:
        block_tables = metadata.block_tables[rows, :num_blocks]
        is_valid = positions < seq_lens
    else:  # on the device: the host plan is only the group's width, so nothing is read back
        first_blocks = (seq_lens - sliding_window).clamp(min=0) // layout.block_size
        columns = first_blocks + torch.arange(num_blocks, device=device)[None, :]
        columns = columns.clamp(max=metadata.block_tables.shape[1] - 1)  # masked beyond the end
        block_tables = metadata.block_tables[rows].gather(1, columns)
        positions = positions + first_blocks * layout.block_size  # absolute positions
        is_valid = (positions < seq_lens) & (positions >= seq_lens - sliding_window)
    return DecodeGroup(rows=rows, block_tables=block_tables, is_valid=is_valid[:, None, None, :])


class TorchAttentionBackend:
    """The `AttentionBackend` reference implementation (any device, any float dtype)."""

    name = "torch"

    def __init__(self) -> None:
        self.workspace = Workspace()
        # The decode grouping is the same for every layer of a step with the same window:
        # planned once per metadata and window.
        self._decode_plan: tuple[AttentionMetadata, dict[int | None, list[DecodeGroup]]] | None
        self._decode_plan = None

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads]
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        check_sliding_window(sliding_window)
        check_logit_softcap(logit_softcap)
        write_kv(kv_cache_layer, key, value, metadata.slot_mapping, kv_scales)
        output = torch.empty_like(query)
        num_decode = metadata.num_decode_seqs
        if num_decode:
            output[:num_decode] = self._decode(
                query[:num_decode], kv_cache_layer, metadata, scale, kv_scales, sliding_window,
                logit_softcap,
            )
        starts = metadata.query_start_loc_cpu
        for seq_index in range(num_decode, metadata.num_seqs):
            self._prefill_one(
                query, output, kv_cache_layer, metadata, seq_index, starts[seq_index], scale,
                kv_scales, sliding_window, logit_softcap,
            )
        return output

    def _decode(
        self,
        query: torch.Tensor,  # [num_decode, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        if self._decode_plan is None or self._decode_plan[0] is not metadata:
            self._decode_plan = (metadata, {})
        plans = self._decode_plan[1]
        if sliding_window not in plans:
            plans[sliding_window] = plan_decode_groups(metadata, sliding_window)
        groups = plans[sliding_window]
        if len(groups) == 1:
            return self._decode_group(query, kv_cache_layer, groups[0], scale, kv_scales,
                                      logit_softcap)
        output = torch.empty_like(query)
        for group in groups:
            output[group.rows] = self._decode_group(
                query[group.rows], kv_cache_layer, group, scale, kv_scales, logit_softcap
            )
        return output

    def _decode_group(
        self,
        query: torch.Tensor,  # [group_size, num_heads, head_dim]
        kv_cache_layer: torch.Tensor,
        group: DecodeGroup,
        scale: float,
        kv_scales: torch.Tensor | None = None,
        logit_softcap: float | None = None,
    ) -> torch.Tensor:
        num_seqs, num_heads, head_dim = query.shape
        keys, values = gather_context(
            kv_cache_layer, group.block_tables, self.workspace, kv_scales, query.dtype
        )
        num_kv_heads = keys.shape[1]
        grouped_query = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
        if logit_softcap is not None:
            out = softcapped_attention(grouped_query, keys.to(query.dtype),
                                       values.to(query.dtype), group.is_valid, scale,
                                       logit_softcap)
            return out.reshape(num_seqs, num_heads, head_dim)
        out = F.scaled_dot_product_attention(
            grouped_query,
            keys.to(query.dtype),
            values.to(query.dtype),
            attn_mask=group.is_valid,
            scale=scale,
        )
        return out.reshape(num_seqs, num_heads, head_dim)

    def _prefill_one(
        self,
        query: torch.Tensor,
        output: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        metadata: AttentionMetadata,
        seq_index: int,
        start: int,
        scale: float,
        kv_scales: torch.Tensor | None = None,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        query_len = metadata.query_lens_cpu[seq_index]
        seq_len = metadata.seq_lens_cpu[seq_index]
        prefix_len = seq_len - query_len
        if sliding_window is not None and sliding_window >= seq_len:
            sliding_window = None  # every window reaches back to position 0: full causal
        # The first token's window starts the earliest: blocks before it are never read.
        first_block = window_first_block(prefix_len + 1, sliding_window, metadata.block_size)
        first_position = first_block * metadata.block_size
        num_blocks = metadata.layout.num_blocks_for_tokens(seq_len)
        table = metadata.block_tables[seq_index : seq_index + 1, first_block:num_blocks]
        keys, values = gather_context(
            kv_cache_layer, table, self.workspace, kv_scales, query.dtype
        )  # [1, Hkv, >=seq_len - first_position, D]
        context_len = seq_len - first_position
        keys = keys[:, :, :context_len].to(query.dtype)
        values = values[:, :, :context_len].to(query.dtype)
        seq_query = query[start : start + query_len].transpose(0, 1)[None]  # [1, H, q_len, D]
        if query_len == seq_len and sliding_window is None and logit_softcap is None:
            mask, is_causal = None, True  # nothing before the chunk: plain causal, no mask
        else:  # query j sits at position prefix_len + j and sees its window's positions
            query_positions = torch.arange(prefix_len, seq_len, device=query.device)[:, None]
            context_positions = torch.arange(first_position, seq_len, device=query.device)[None]
            mask, is_causal = context_positions <= query_positions, False
            if sliding_window is not None:
                mask &= context_positions > query_positions - sliding_window
        if logit_softcap is not None:
            out = softcapped_attention(seq_query, keys, values, mask, scale, logit_softcap)
        else:
            out = grouped_query_sdpa(
                seq_query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scale
            )  # [1, H, q_len, D]
        output[start : start + query_len] = out[0].transpose(0, 1)

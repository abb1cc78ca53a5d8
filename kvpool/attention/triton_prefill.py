"""Triton paged prefill / extend attention: the new tokens of each sequence, attending causally
over their whole context (cached prefix + themselves) read through the block table.

Work split: one program per (sequence, query tile, KV head). A query tile's rows are
(token, query head) pairs of the heads sharing one KV head, token-major:

    row r  ->  token  tile_start + r // GROUP,  query head  kv_head * GROUP + r % GROUP

so each K/V tile is loaded once for the whole head group (GQA), and `BLOCK_M // GROUP` new
tokens share a program. K/V rows are gathered token by token through the block table, so tiles
of `block_n` tokens need not line up with KV blocks.

The context walk has two phases: tiles wholly before the tile's first query position need no
mask (every row sees every key), the rest — the diagonal — apply the causal mask. Online softmax
in fp32 with exp2, the scale folded into log2 units.

Sliding window (`sliding_window=W`, `kvpool.attention.backend`): the row at position p sees
keys p - W < k <= p. The walk starts at the tile holding the first row's window start (tiles
before every row's window are never read; tiles stay aligned to `block_n`, as in decode) and
gains a third phase in front: the keys some rows see and others do not, masked on both sides,
then the keys every row sees (unmasked), then the diagonal, masked on both sides too. Without a
window the first phase is empty and the walk is the two phases above. W is a runtime scalar
(0: none), so one compiled variant serves every window and none.

            |<- before every row's window ->|<- head: masked ->|<- all see ->|<- diagonal ->|
    keys:   0                               lo           mid_begin       mid_end       last+1
            (lo, mid_begin and mid_end are multiples of block_n)

Soft-capped scores (`logit_softcap`): as in decode (`triton_tiles.soft_cap`, the constexpr
`SOFTCAP`), each tile's scores are capped before its mask.

Quantized KV (int8 / fp8 codes with `kv_scales`): every K/V tile is dequantized in registers
(`triton_tiles.load_kv_tile` and `dequantize_tile`, shared with decode), into the query's
dtype, before the tile's dots.

Invariants: K/V of every context token, the new ones included, are already in the cache;
`query_start_loc[i]` indexes the rows of `query` of sequence i (it need not start at 0, so a
caller can pass the prefill part of a mixed batch as views); `1 <= query_len <= seq_len`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvpool.attention.triton_kv import kv_quant_mode, scale_strides
from kvpool.attention.triton_tiles import (
    dequantize_tile,
    dot_precision,
    load_kv_tile,
    score_scales,
    soft_cap,
)


@dataclass(frozen=True, slots=True)
class PrefillConfig:
    """Tile shape and launch parameters of the prefill kernel."""

    block_m: int = 64  # (token, head) rows per program (a power of two, >= 16)
    block_n: int = 64  # context tokens per tile (a power of two, >= 16)
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            size = getattr(self, name)
            if size < 16 or size & (size - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {size}")


@triton.jit
def _attend_tiles(
    q,
    m_i,
    l_i,
    acc,
    kv_head_ptr,
    scale_head_ptr,
    block_table_ptr,
    row_pos,
    tile_begin,
    tile_end,
    scale_log2,
    softcap_log2,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_s_block,
    stride_s_kv,
    stride_s_slot,
    dims,
    dim_mask,
    window,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """Fold context tokens [tile_begin, tile_end) into the running softmax state; `CAUSAL`
    masks each row's keys to its window `row_pos - window < k <= row_pos`, else every key of
    the range is visible to every row."""
    for tile_start in range(tile_begin, tile_end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < tile_end
        k, v, k_scales, v_scales = load_kv_tile(
            kv_head_ptr, scale_head_ptr, block_table_ptr, tokens, token_mask, dims, dim_mask,
            stride_kv_block, stride_kv_kv, stride_kv_slot, stride_s_block, stride_s_kv,
            stride_s_slot, BLOCK_SIZE, KV_QUANT,
        )  # fmt: skip

        # Both tiles widened here: measured on sm_90, widening V just before its dot (as decode
        # does) keeps it alive beside the [BLOCK_M, BLOCK_D] accumulator and costs registers.
        k = dequantize_tile(k, k_scales, KV_QUANT, q.dtype)
        v = dequantize_tile(v, v_scales, KV_QUANT, q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        if CAUSAL:
            is_after = tokens[None, :] > row_pos[:, None] - window
            visible = (tokens[None, :] <= row_pos[:, None]) & is_after & token_mask[None, :]
        else:
            visible = token_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        if CAUSAL:  # a row may see none of a tile yet (its window starts later): no -inf - -inf
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


# The step's sequence tensors come whole, with the first prefill's row (`first_seq`, after the
# decodes), rather than sliced: a slice's address would change its 16-byte alignment, and
# with it the compiled variant, with the number of decodes in the step.
@triton.jit(do_not_specialize=["first_seq", "sliding_window", "stride_bt_seq"])
def _prefill_kernel(
    query_ptr,
    kv_ptr,
    scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    softcap_log2,
    first_seq,
    sliding_window,
    stride_q_token,
    stride_q_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    stride_s_block,
    stride_s_kv,
    stride_s_slot,
    stride_bt_seq,
    stride_out_token,
    stride_out_head,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    TOKENS_PER_TILE: tl.constexpr = BLOCK_M // GROUP
    seq_id = first_seq + tl.program_id(0)
    tile_first_token = tl.program_id(1) * TOKENS_PER_TILE
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_loc_ptr + seq_id)
    query_len = tl.load(query_start_loc_ptr + seq_id + 1) - query_start
    if tile_first_token < query_len:  # the grid covers the longest query; shorter ones idle
        seq_len = tl.load(seq_lens_ptr + seq_id)
        prefix_len = seq_len - query_len

        rows = tl.arange(0, BLOCK_M)
        tokens = tile_first_token + rows // GROUP
        heads = kv_head * GROUP + rows % GROUP
        row_mask = (rows < TOKENS_PER_TILE * GROUP) & (tokens < query_len)
        row_pos = prefix_len + tokens  # absolute position of each row's token
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        io_mask = row_mask[:, None] & dim_mask[None, :]
        q_ptrs = (
            query_ptr
            + (query_start + tokens)[:, None].to(tl.int64) * stride_q_token
            + heads[:, None] * stride_q_head
            + dims[None, :]
        )
        q = tl.load(q_ptrs, mask=io_mask, other=0.0)  # [BLOCK_M, BLOCK_D]

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        kv_head_ptr = kv_ptr + kv_head * stride_kv_head
        scale_head_ptr = scales_ptr + kv_head  # the scales' head dimension is contiguous
        block_table_ptr = block_tables_ptr + seq_id.to(tl.int64) * stride_bt_seq
        first_pos = prefix_len + tile_first_token
        last_pos = tl.minimum(first_pos + TOKENS_PER_TILE, seq_len) - 1
        # No window is a window reaching position 0 from every row.
        window = tl.where(sliding_window > 0, sliding_window, seq_len + 1)
        # The first row's window starts in the tile at lo.
        lo = tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N
        # Keys up to first_pos are visible to every row; whole tiles of them skip the mask...
        mid_end = (first_pos + 1) // BLOCK_N * BLOCK_N
        # ... and so are the keys from the last row's window start on (whole tiles again).
        last_row_start = tl.cdiv(tl.maximum(last_pos - window + 1, 0), BLOCK_N) * BLOCK_N
        mid_begin = tl.minimum(last_row_start, mid_end)  # lo <= both
        # The three phases: head (masked), middle (unmasked), diagonal (masked).
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, kv_head_ptr, scale_head_ptr, block_table_ptr, row_pos, lo,
            mid_begin, scale_log2, softcap_log2, stride_kv_block, stride_kv_kv, stride_kv_slot,
            stride_s_block, stride_s_kv, stride_s_slot, dims, dim_mask, window, BLOCK_SIZE,
            BLOCK_N, True, DOT_PRECISION, KV_QUANT, SOFTCAP,
        )  # fmt: skip
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, kv_head_ptr, scale_head_ptr, block_table_ptr, row_pos, mid_begin,
            mid_end, scale_log2, softcap_log2, stride_kv_block, stride_kv_kv, stride_kv_slot,
            stride_s_block, stride_s_kv, stride_s_slot, dims, dim_mask, window, BLOCK_SIZE,
            BLOCK_N, False, DOT_PRECISION, KV_QUANT, SOFTCAP,
        )  # fmt: skip
        m_i, l_i, acc = _attend_tiles(
            q, m_i, l_i, acc, kv_head_ptr, scale_head_ptr, block_table_ptr, row_pos, mid_end,
            last_pos + 1, scale_log2, softcap_log2, stride_kv_block, stride_kv_kv, stride_kv_slot,
            stride_s_block, stride_s_kv, stride_s_slot, dims, dim_mask, window, BLOCK_SIZE,
            BLOCK_N, True, DOT_PRECISION, KV_QUANT, SOFTCAP,
        )  # fmt: skip

        l_i = tl.where(l_i > 0, l_i, 1.0)  # a padding row's window may hold no key: not stored
        out = acc / l_i[:, None]
        out_ptrs = (
            out_ptr
            + (query_start + tokens)[:, None].to(tl.int64) * stride_out_token
            + heads[:, None] * stride_out_head
            + dims[None, :]
        )
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


def paged_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32, rows of `query` per sequence
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    config: PrefillConfig | None = None,
    kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads] float32
    first_seq: int = 0,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves,
    each token over its last `sliding_window` positions if given, its scores soft-capped at
    `logit_softcap` if given, for sequences
    `first_seq ..` of the step (the earlier ones are its decodes).

    Rows of `query` outside those sequences' ranges are left untouched in `out`. A quantized
    cache (int8 / fp8 codes) needs its `kv_scales`.
    """
    config = config or PrefillConfig()
    _, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache_layer.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert query.stride(2) == 1 and kv_cache_layer.stride(4) == 1
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.stride(2) == 1
    kv_quant = kv_quant_mode(kv_cache_layer, kv_scales)
    num_seqs = seq_lens.shape[0] - first_seq
    group = num_heads // num_kv_heads
    if num_seqs == 0 or max_query_len == 0:
        return out
    block_m = max(config.block_m, triton.next_power_of_2(group))
    grid = (num_seqs, triton.cdiv(max_query_len, block_m // group), num_kv_heads)
    _prefill_kernel[grid](
        query,
        kv_cache_layer,
        kv_cache_layer if kv_scales is None else kv_scales,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        *score_scales(scale, logit_softcap),
        first_seq,
        sliding_window or 0,  # 0: none
        query.stride(0),
        query.stride(1),
        *kv_cache_layer.stride()[:4],
        *scale_strides(kv_scales),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=config.block_n,
        DOT_PRECISION=dot_precision(query.dtype),
        KV_QUANT=kv_quant,
        SOFTCAP=logit_softcap is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out

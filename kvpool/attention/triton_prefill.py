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

Quantized KV (int8 / fp8 codes with `kv_scales`): every K/V tile is dequantized in registers
(`triton_decode.load_kv_tile` and `dequantize_tile`, shared with decode), into the query's
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

from kvpool.attention.triton_decode import LOG2_E, dequantize_tile, dot_precision, load_kv_tile
from kvpool.attention.triton_kv import kv_quant_mode, scale_strides


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
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_s_block,
    stride_s_kv,
    stride_s_slot,
    dims,
    dim_mask,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """Fold context tokens [tile_begin, tile_end) into the running softmax state."""
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
        if CAUSAL:
            visible = (tokens[None, :] <= row_pos[:, None]) & token_mask[None, :]
        else:
            visible = token_mask[None, :]
        scores = tl.where(visible, scores, float("-inf"))  # [BLOCK_M, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
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
@triton.jit(do_not_specialize=["first_seq", "stride_bt_seq"])
def _prefill_kernel(
    query_ptr,
    kv_ptr,
    scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    scale_log2,
    first_seq,
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
        # Keys up to first_pos are visible to every row; whole tiles of them skip the mask.
        unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
        m_i, l_i, acc = _attend_tiles(
            q,
            m_i,
            l_i,
            acc,
            kv_head_ptr,
            scale_head_ptr,
            block_table_ptr,
            row_pos,
            0,
            unmasked_end,
            scale_log2,
            stride_kv_block,
            stride_kv_kv,
            stride_kv_slot,
            stride_s_block,
            stride_s_kv,
            stride_s_slot,
            dims,
            dim_mask,
            BLOCK_SIZE,
            BLOCK_N,
            False,
            DOT_PRECISION,
            KV_QUANT,
        )
        m_i, l_i, acc = _attend_tiles(
            q,
            m_i,
            l_i,
            acc,
            kv_head_ptr,
            scale_head_ptr,
            block_table_ptr,
            row_pos,
            unmasked_end,
            last_pos + 1,
            scale_log2,
            stride_kv_block,
            stride_kv_kv,
            stride_kv_slot,
            stride_s_block,
            stride_s_kv,
            stride_s_slot,
            dims,
            dim_mask,
            BLOCK_SIZE,
            BLOCK_N,
            True,
            DOT_PRECISION,
            KV_QUANT,
        )

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
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves,
    for sequences `first_seq ..` of the step (the earlier ones are its decodes).

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
        scale * LOG2_E,
        first_seq,
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
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out

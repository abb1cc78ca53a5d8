"""Triton paged decode attention: one query token per sequence over its paged context.

Work split (flash-decoding): one program per (sequence, KV head, split). The program loads the
query rows of every query head that shares its KV head (GQA grouping: rows padded to at least
16 for the tensor cores), then walks its range of the context in tiles of `block_n` tokens; each
token's K/V row is gathered through the block table, so a tile may span several KV blocks or
part of one. Each K/V tile is read once for the whole head group, with an online softmax in fp32
(exp2, with the scale folded into log2 units).

When a batch has too few (sequence, KV head) pairs to fill the GPU, the context is split into
`num_splits` ranges whose partial results (normalised output + log-sum-exp) are merged by a
second, small reduction kernel. `choose_num_splits` picks the split count from the batch size and
the context length; with one split the first kernel writes the output directly.

Quantized KV (int8 / fp8 codes with `kv_scales`, `kvpool.attention.triton_kv`): `load_kv_tile`
(`kvpool.attention.triton_tiles`, shared with prefill) loads a tile's codes and its tokens' K
and V scales (one per token, gathered through the same block table), and `dequantize_tile`
widens each tile in registers just before its `tl.dot`, `(code.to(fp32) * scale).to(query
dtype)`: exactly what the torch reference computes on its gathered copy, while no dequantized
copy of the context ever exists here. fp8 codes are loaded as fp8 (the interpreter widens all
256 codes exactly; the GPU converts them in hardware). The constexpr `KV_QUANT` leaves the
float path as it was.

Sliding window (`sliding_window=W`, `kvpool.attention.backend`): a sequence attends to its
context positions [max(0, seq_len - W), seq_len). The walk starts at the tile holding the
window's start and the splits divide the tiles from there on, so no program reads a tile
before the window; a split left empty stores nothing and the reduction skips it, as for short
contexts. Tiles stay aligned to `block_n`: the first one may load up to `block_n - 1` tokens
before the window (the sequence's own, finite K/V), masked out of its scores. Masking the loads
on both sides instead cost ~16 registers a thread on sm_90 (88 -> 104, one program fewer per
multiprocessor; `tests/attention/triton_compile.py`), peeling the first tile ~18. W is a
runtime scalar (0: none), never a specialisation: one compiled variant serves every window and
none.

Soft-capped scores (`logit_softcap=c`, `kvpool.attention.backend`): with the constexpr
`SOFTCAP` the score multiplier is `scale / c` instead of `scale * log2(e)`, and `soft_cap` turns
each score t into `c * log2(e) * tanh(t)`, log2 units again, before the mask (tanh through the
sigmoid, `2 * sigmoid(2t) - 1`: tl has no tanh). The cap is a property of the model, so the
flag is too: the backend's warm-up compiles the variants the model uses (`triton_backend`), and
`SOFTCAP=False` compiles to the uncapped kernel unchanged. The cap's value is a runtime float.

Invariants: every sequence has `seq_len >= 1`; `block_tables[i]` holds valid ids for its first
`ceil(seq_len / block_size)` entries; the K/V of every context token is already in the cache.
"""

from __future__ import annotations

import math
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

MIN_TOKENS_PER_SPLIT = 256  # below this a split's reduction costs more than its parallelism
MAX_SPLITS = 64


@dataclass(frozen=True, slots=True)
class DecodeConfig:
    """Tile shape and launch parameters of the decode kernel."""

    block_n: int = 64  # context tokens per tile (a power of two, >= 16)
    num_warps: int = 4
    num_stages: int = 3  # sm_90: K/V tiles and block-table reads both go through cp.async

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    block_n: int = 64,
    sliding_window: int | None = None,
) -> int:
    """How many context splits fill `num_sms` multiprocessors about twice over.

    Splitting pays only while the batch alone leaves multiprocessors idle, and only for contexts
    long enough that each split still streams at least `MIN_TOKENS_PER_SPLIT` tokens; under a
    sliding window, the context a split divides is the window.
    """
    num_programs = num_seqs * num_kv_heads
    if num_programs == 0:
        return 1
    wanted = math.ceil(2 * num_sms / num_programs)
    max_attended = min(max_seq_len, sliding_window or max_seq_len)
    by_length = max(1, max_attended // max(MIN_TOKENS_PER_SPLIT, block_n))
    return max(1, min(wanted, by_length, MAX_SPLITS))


@triton.jit
def _window_start(seq_len, sliding_window):
    """The first context position a decode attends to: 0 without a window (0)."""
    return tl.where(sliding_window > 0, tl.maximum(seq_len - sliding_window, 0), 0)


@triton.jit
def _first_tile(seq_len, sliding_window, BLOCK_N: tl.constexpr):
    """Where the walk starts: the tile holding the window's start (tiles stay aligned)."""
    return _window_start(seq_len, sliding_window) // BLOCK_N * BLOCK_N


@triton.jit
def _tokens_per_split(seq_len, sliding_window, num_splits, BLOCK_N: tl.constexpr):
    """Each split's share of the tiles from the window's first on, in whole tiles."""
    num_walked = seq_len - _first_tile(seq_len, sliding_window, BLOCK_N)
    return tl.cdiv(tl.cdiv(num_walked, num_splits), BLOCK_N) * BLOCK_N


@triton.jit
def _split_range(seq_len, sliding_window, split_id, num_splits, BLOCK_N: tl.constexpr):
    """[start, end) of this split's context tokens: the tiles from the window's first on, cut
    into whole tiles per split, the last one short."""
    tokens_per_split = _tokens_per_split(seq_len, sliding_window, num_splits, BLOCK_N)
    start = _first_tile(seq_len, sliding_window, BLOCK_N) + split_id * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    return start, end


# Scalars that change from step to step are not specialised on (Triton would otherwise compile
# a new variant whenever one becomes 1 or a multiple of 16): the split count, the block table's
# width, and the strides of outputs shaped by the split count; nor the window, which differs
# between layers. So one variant per IS_SPLIT serves every step and layer, and the warm-up's
# first call compiles it (`TritonAttentionBackend`).
@triton.jit(do_not_specialize=["num_splits", "sliding_window", "stride_bt_seq", "stride_out_seq",
                               "stride_out_head", "stride_out_split", "stride_lse_seq",
                               "stride_lse_head"])
def _decode_kernel(
    query_ptr,
    kv_ptr,
    scales_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
    scale_log2,
    softcap_log2,
    num_splits,
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
    stride_out_seq,
    stride_out_head,
    stride_out_split,
    stride_lse_seq,
    stride_lse_head,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    seq_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split_id = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq_id)
    start, end = _split_range(seq_len, sliding_window, split_id, num_splits, BLOCK_N)
    window_start = _window_start(seq_len, sliding_window)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    row_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q_ptrs = query_ptr + seq_id * stride_q_token + heads[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptrs, mask=row_mask[:, None] & dim_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_D]

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    kv_head_ptr = kv_ptr + kv_head * stride_kv_head
    scale_head_ptr = scales_ptr + kv_head  # the scales' head dimension is contiguous
    block_table_ptr = block_tables_ptr + seq_id.to(tl.int64) * stride_bt_seq
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        k, v, k_scales, v_scales = load_kv_tile(
            kv_head_ptr, scale_head_ptr, block_table_ptr, tokens, token_mask, dims, dim_mask,
            stride_kv_block, stride_kv_kv, stride_kv_slot, stride_s_block, stride_s_kv,
            stride_s_slot, BLOCK_SIZE, KV_QUANT,
        )  # fmt: skip

        k = dequantize_tile(k, k_scales, KV_QUANT, q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        if SOFTCAP:
            scores = soft_cap(scores, softcap_log2)
        is_attended = token_mask & (tokens >= window_start)
        scores = tl.where(is_attended[None, :], scores, float("-inf"))  # [BLOCK_H, BLOCK_N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = dequantize_tile(v, v_scales, KV_QUANT, q.dtype)
        acc = tl.dot(p.to(v.dtype), v, acc=acc, input_precision=DOT_PRECISION)
        m_i = m_new

    l_i = tl.where(l_i > 0, l_i, 1.0)  # an empty split folded nothing; it stores nothing below
    out = acc / l_i[:, None]
    out_ptrs = (
        out_ptr
        + seq_id * stride_out_seq
        + heads[:, None] * stride_out_head
        + split_id * stride_out_split
        + dims[None, :]
    )
    # An empty split (start >= end) stores nothing; the reduction skips it by the same arithmetic.
    store_rows = rows < tl.where(start < end, GROUP, 0)
    store_mask = store_rows[:, None] & dim_mask[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=store_mask)
    if IS_SPLIT:
        lse_ptrs = lse_ptr + seq_id * stride_lse_seq + heads * stride_lse_head + split_id
        tl.store(lse_ptrs, m_i + tl.log2(l_i), mask=store_rows)


@triton.jit(do_not_specialize=["num_splits", "sliding_window", "stride_partial_seq",
                               "stride_partial_head", "stride_partial_split", "stride_lse_seq",
                               "stride_lse_head"])
def _reduce_kernel(
    partial_ptr,
    lse_ptr,
    seq_lens_ptr,
    out_ptr,
    num_splits,
    sliding_window,
    stride_partial_seq,
    stride_partial_head,
    stride_partial_split,
    stride_lse_seq,
    stride_lse_head,
    stride_out_token,
    stride_out_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (sequence, query head): merge the non-empty splits by their log-sum-exp.
    seq_id = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq_id)
    tokens_per_split = _tokens_per_split(seq_len, sliding_window, num_splits, BLOCK_N)
    num_walked = seq_len - _first_tile(seq_len, sliding_window, BLOCK_N)
    num_used_splits = tl.cdiv(num_walked, tokens_per_split)

    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_used_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    lse = tl.load(
        lse_ptr + seq_id * stride_lse_seq + head * stride_lse_head + splits,
        mask=split_mask,
        other=float("-inf"),
    )  # [BLOCK_S], log2 units
    weights = tl.exp2(lse - tl.max(lse, axis=0))
    partial_ptrs = (
        partial_ptr
        + seq_id * stride_partial_seq
        + head * stride_partial_head
        + splits[:, None] * stride_partial_split
        + dims[None, :]
    )
    partial = tl.load(partial_ptrs, mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(partial * weights[:, None], axis=0) / tl.sum(weights, axis=0)  # [BLOCK_D]
    out_ptrs = out_ptr + seq_id * stride_out_token + head * stride_out_head + dims
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter gains nothing from splits; tests force them explicitly


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, head_dim]
    num_splits: int | None = None,
    config: DecodeConfig | None = None,
    kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads] float32
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:
    """Attention of each sequence's one query token over its whole paged context, or over its
    last `sliding_window` positions; scores soft-capped at `logit_softcap` if given.

    `max_seq_len` (a host int) drives the split heuristic; `num_splits` overrides it. A
    quantized cache (int8 / fp8 codes) needs its `kv_scales`.
    """
    config = config or DecodeConfig()
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, cache_head_dim = kv_cache_layer.shape[3:]
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert query.stride(2) == 1 and kv_cache_layer.stride(4) == 1
    out = torch.empty_like(query) if out is None else out
    assert out.shape == query.shape and out.stride(2) == 1
    kv_quant_mode(kv_cache_layer, kv_scales)  # asserts that the scales fit the cache
    if num_seqs == 0:
        return out
    window = sliding_window or 0  # the kernels' scalar: 0 is none
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, max_seq_len, _num_sms(query.device), config.block_n,
            sliding_window,
        )
    cache = (kv_cache_layer, kv_scales)
    scales = (scale, logit_softcap)
    if num_splits == 1:
        _launch_decode(query, cache, block_tables, seq_lens, window, scales, config, out, None)
        return out
    # [num_seqs, num_heads, num_splits, head_dim] outputs and [..., num_splits] log-sum-exps
    partial = query.new_empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32)
    lse = query.new_empty((num_seqs, num_heads, num_splits), dtype=torch.float32)
    _launch_decode(query, cache, block_tables, seq_lens, window, scales, config, partial, lse)
    _reduce_kernel[(num_seqs, num_heads)](
        partial,
        lse,
        seq_lens,
        out,
        num_splits,
        window,
        *partial.stride()[:3],
        *lse.stride()[:2],
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_S=triton.next_power_of_2(MAX_SPLITS),  # one variant for every split count
        BLOCK_N=config.block_n,
        num_warps=4,
    )
    return out


def _launch_decode(
    query: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor | None],  # the layer view and its scales (or None)
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sliding_window: int,  # 0: none
    scales: tuple[float, float | None],  # the attention scale and the soft-cap (or None)
    config: DecodeConfig,
    out: torch.Tensor,  # [num_seqs, num_heads, head_dim], or per split with `lse`
    lse: torch.Tensor | None,  # [num_seqs, num_heads, num_splits] when split
) -> None:
    kv_cache_layer, kv_scales = cache
    scale, logit_softcap = scales
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache_layer.shape[3]
    num_splits = 1 if lse is None else lse.shape[2]
    group = num_heads // num_kv_heads
    # Unsplit, the split dimension of `out` and the log-sum-exps do not exist: strides 0.
    out_strides = out.stride()[:3] if lse is not None else (out.stride(0), out.stride(1), 0)
    lse_strides = lse.stride()[:2] if lse is not None else (0, 0)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        kv_cache_layer,
        kv_cache_layer if kv_scales is None else kv_scales,
        block_tables,
        seq_lens,
        out,
        out if lse is None else lse,
        *score_scales(scale, logit_softcap),
        num_splits,
        sliding_window,
        query.stride(0),
        query.stride(1),
        *kv_cache_layer.stride()[:4],
        *scale_strides(kv_scales),
        block_tables.stride(0),
        *out_strides,
        *lse_strides,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache_layer.shape[2],
        BLOCK_N=config.block_n,
        IS_SPLIT=lse is not None,
        DOT_PRECISION=dot_precision(query.dtype),
        KV_QUANT=kv_quant_mode(kv_cache_layer, kv_scales),
        SOFTCAP=logit_softcap is not None,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )

"""Device functions both Triton attention kernels use (`triton_decode`, `triton_prefill`):
gathering a tile of K/V (codes and scales for a quantized cache) through a block table,
widening codes in registers, and the score multipliers and tanh of soft-capped attention.

Their contracts are the kernels' (see `triton_decode`'s module docstring): a tile's tokens are
masked, not clipped, so its shape is the constexpr `[BLOCK_N, BLOCK_D]` whatever the context.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634


@triton.jit
def load_kv_tile(
    kv_head_ptr,
    scale_head_ptr,
    block_table_ptr,
    tokens,
    token_mask,
    dims,
    dim_mask,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_s_block,
    stride_s_kv,
    stride_s_slot,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    """K and V of context `tokens` of one sequence and KV head, read through its block table:
    two `[BLOCK_N, BLOCK_D]` tiles, zero where a token or dimension is masked out, and for a
    quantized cache (`KV_QUANT` != 0) the tokens' K and V scales (`[BLOCK_N]`; 1.0 otherwise).
    Codes stay codes here: the caller widens each tile with `dequantize_tile` where that costs
    the fewest registers (decode: each just before its `tl.dot`, so one wide tile is live)."""
    block_ids = tl.load(block_table_ptr + tokens // BLOCK_SIZE, mask=token_mask, other=0)
    block_ids = block_ids.to(tl.int64)
    slots = tokens % BLOCK_SIZE
    row_offsets = block_ids * stride_kv_block + slots * stride_kv_slot
    kv_ptrs = kv_head_ptr + row_offsets[:, None] + dims[None, :]  # [BLOCK_N, BLOCK_D]
    kv_mask = token_mask[:, None] & dim_mask[None, :]
    k = tl.load(kv_ptrs, mask=kv_mask, other=0.0)
    v = tl.load(kv_ptrs + stride_kv_kv, mask=kv_mask, other=0.0)
    if KV_QUANT != 0:
        scale_ptrs = scale_head_ptr + block_ids * stride_s_block + slots * stride_s_slot
        k_scales = tl.load(scale_ptrs, mask=token_mask, other=0.0)
        v_scales = tl.load(scale_ptrs + stride_s_kv, mask=token_mask, other=0.0)
    else:
        k_scales = 1.0
        v_scales = 1.0
    return k, v, k_scales, v_scales


@triton.jit
def dequantize_tile(codes, scales, KV_QUANT: tl.constexpr, DTYPE: tl.constexpr):
    """A `[BLOCK_N, BLOCK_D]` tile of codes times its tokens' `scales`, in registers, rounded to
    `DTYPE` (the query's): `kv_quant.dequantize` to the bit. A float tile passes unchanged."""
    if KV_QUANT != 0:
        return (codes.to(tl.float32) * scales[:, None]).to(DTYPE)
    else:
        return codes


def score_scales(scale: float, logit_softcap: float | None) -> tuple[float, float]:
    """The kernels' two score multipliers, (score_scale, softcap_log2): without a cap the
    softmax's log2 units `scale * log2(e)` (and an unused 0); with cap c, `scale / c`, the
    tanh's argument, and `c * log2(e)`, which brings the tanh to log2 units."""
    if logit_softcap is None:
        return scale * LOG2_E, 0.0
    return scale / logit_softcap, logit_softcap * LOG2_E


@triton.jit
def soft_cap(scores, softcap_log2):
    """`softcap_log2 * tanh(scores)` for scores already divided by the cap (`score_scales`)."""
    return softcap_log2 * (2.0 * tl.sigmoid(2.0 * scores) - 1.0)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through TF32 on the GPU; 16-bit inputs ignore this.
    return "ieee" if dtype == torch.float32 else "tf32"

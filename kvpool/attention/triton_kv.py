"""Triton kernels that move KV data: writing a step's new K/V into their slots (the kernel
only: `kvpool.attention.kv_write.write_kv_triton` launches it, with the op's reference and
check beside it), and copying whole blocks (copy-on-write, migration).

Layout (`kvpool.attention.backend`): a layer view is
`[num_blocks, 2, block_size, num_kv_heads, head_dim]`, strided across blocks; the whole cache is
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, in which each block is one
contiguous range. The kernels take strides, so they work on either; only the innermost
dimension must be contiguous.

Quantized KV (`kv_cache_dtype` int8 / fp8, `kvpool.memory.kv_quant`): the cache holds codes
and a scale tensor `[num_blocks, 2, block_size, num_kv_heads]` float32 (a layer view of
`KVCache.scales`; innermost dimension contiguous) holds one scale per (token, KV head), K and V
apart. `write_kv_kernel` quantizes, as `kv_quant.quantize` does: per row
`scale = amax(|row|) / qmax` (1 for an all-zero row), code = `row / scale` clamped to ±qmax and
rounded to nearest even (int8 to an integer; fp8 to the format, in integer arithmetic on the
float32 bits, because the interpreter's float → fp8 conversion does not round to nearest even).
Both divisions are IEEE (`div_rn`; plain `/` is approximate on the GPU), so codes and scales
equal the torch reference's bit for bit. `KV_QUANT` (a constexpr: `kv_quant_mode`, from the
kernels' dtype table `kvpool.kernels.dtypes`) selects the path, so a float cache compiles to the
kernel it always was. The scales of a block move with its codes: `copy_blocks` on the scale
tensor copies them (each block is one contiguous range there too).

Invariants the callers keep (checked on the host where that is free):
- `slot_mapping` holds one slot per new token, `block_id * block_size + offset`, all distinct;
  a negative slot (`metadata.PAD_SLOT_ID`) marks a padded token, whose K/V the write skips
  (the rows that pad a graphed decode to its batch size: `kvpool.engine.decode_graphs`).
- Block copies: destination ids are distinct and none of them is also a source, so the copies
  are independent and may run in any order, in parallel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from kvpool.kernels import dtypes
from kvpool.kernels.dtypes import KV_QUANT_NONE

COPY_CHUNK = 4096  # elements per program in the block copy: 8 KiB of bf16, 16 B per thread


def kv_quant_mode(kv_cache_layer: torch.Tensor, kv_scales: torch.Tensor | None) -> int:
    """The kernels' `KV_QUANT` for a cache layer view and its scales (None for a float cache);
    asserts that the scales fit the cache: `[num_blocks, 2, block_size, num_kv_heads]` float32,
    innermost dimension contiguous."""
    mode = dtypes.kv_quant_mode(kv_cache_layer.dtype)
    if mode == KV_QUANT_NONE:
        assert kv_scales is None, f"a {kv_cache_layer.dtype} KV cache has no scales"
        return mode
    assert kv_scales is not None, f"a {kv_cache_layer.dtype} KV cache needs kv_scales"
    assert kv_scales.shape == kv_cache_layer.shape[:4], "scales must be [blocks, 2, slots, heads]"
    assert kv_scales.dtype == torch.float32 and kv_scales.stride(3) == 1
    assert kv_scales.device == kv_cache_layer.device
    return mode


def scale_strides(kv_scales: torch.Tensor | None) -> tuple[int, int, int]:
    """(block, K/V, slot) strides of the scale tensor; zeros without one."""
    return (0, 0, 0) if kv_scales is None else tuple(kv_scales.stride()[:3])


@triton.jit
def _round_half_even(x):
    """x rounded to the nearest integer, ties to even (|x| < 2**22; IEEE addition rounds)."""
    magic = 12582912.0  # 1.5 * 2**23: the sum's last place is 1
    return (x + magic) - magic


@triton.jit
def _fp8_bits(x, MANTISSA: tl.constexpr, BIAS: tl.constexpr):
    """The 8-bit pattern of float32 `x` (finite, |x| <= the format's max) in an fp8 format with
    `MANTISSA` bits and exponent bias `BIAS`, rounded to nearest even, as int32.

    Integer arithmetic on the float32 bits (as torch's `c10` conversion does for normals), so
    the interpreter and the GPU give the same code: normals add the rebias and the rounding
    increment to the bits (a mantissa carry moves into the exponent, as it should); values below
    the smallest normal are shifted into the subnormal range with an explicit tie-to-even."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    mag = bits & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MANTISSA  # float32 mantissa bits that go
    normal = mag + (((BIAS - 127) << 23) + (1 << (drop - 1)) - 1) + ((mag >> drop) & 1)
    normal = normal >> drop
    # Subnormal: |x| / 2**(1 - BIAS - MANTISSA), the float32 significand shifted right.
    significand = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum((151 - BIAS - MANTISSA) - (mag >> 23), 1), 25)  # normals: 1
    kept = significand >> shift
    rest = significand & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    kept += ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    is_normal = mag >= ((128 - BIAS) << 23)  # |x| >= 2**(1 - BIAS)
    return (sign << 7) | tl.where(is_normal, normal, kept)


@triton.jit
def quantize_rows(rows, KV_QUANT: tl.constexpr, QMAX: tl.constexpr, CODE_TYPE: tl.constexpr):
    """`[R, D]` float rows → (codes `[R, D]` of `CODE_TYPE`, scales `[R]` float32): one symmetric
    scale per row, `kvpool.memory.kv_quant.quantize` to the bit (masked entries must be 0; a
    wholly masked row gets scale 1)."""
    rows = rows.to(tl.float32)
    amax = tl.max(tl.abs(rows), axis=1)
    scales = tl.where(amax > 0, tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), 1.0)
    scaled = tl.math.div_rn(rows, tl.broadcast_to(scales[:, None], rows.shape))
    scaled = tl.minimum(tl.maximum(scaled, -QMAX), QMAX)
    if KV_QUANT == 1:  # int8
        codes = _round_half_even(scaled).to(CODE_TYPE)
    elif KV_QUANT == 2:  # float8 e4m3fn
        codes = _fp8_bits(scaled, 3, 7).to(tl.uint8).to(CODE_TYPE, bitcast=True)
    else:  # float8 e5m2
        codes = _fp8_bits(scaled, 2, 15).to(tl.uint8).to(CODE_TYPE, bitcast=True)
    return codes, scales


@triton.jit
def write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    scales_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    stride_s_block,
    stride_s_kv,
    stride_s_slot,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    QMAX: tl.constexpr,
):
    # One program per new token: all of its heads, K and V, in one pass.
    token_id = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_id).to(tl.int64)
    # A negative slot (PAD_SLOT_ID) is a padded token: no head is read or stored.
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    slot = tl.maximum(slot, 0)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)  # [BLOCK_HEADS, BLOCK_D]

    key = tl.load(
        key_ptr + token_id * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
        other=0.0,
    )
    value = tl.load(
        value_ptr
        + token_id * stride_value_token
        + heads[:, None] * stride_value_head
        + dims[None, :],
        mask=mask,
        other=0.0,
    )
    dst = kv_ptr + block_id * stride_kv_block + offset * stride_kv_slot
    dst = dst + heads[:, None] * stride_kv_head + dims[None, :]
    code_type = kv_ptr.dtype.element_ty
    if KV_QUANT == 0:
        tl.store(dst, key.to(code_type), mask=mask)
        tl.store(dst + stride_kv_kv, value.to(code_type), mask=mask)
    else:
        head_mask = heads < num_heads
        key_codes, key_scales = quantize_rows(key, KV_QUANT, QMAX, code_type)
        value_codes, value_scales = quantize_rows(value, KV_QUANT, QMAX, code_type)
        tl.store(dst, key_codes, mask=mask)
        tl.store(dst + stride_kv_kv, value_codes, mask=mask)
        scale_dst = scales_ptr + block_id * stride_s_block + offset * stride_s_slot + heads
        tl.store(scale_dst, key_scales, mask=head_mask)
        tl.store(scale_dst + stride_s_kv, value_scales, mask=head_mask)


@triton.jit
def _copy_blocks_kernel(
    kv_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    stride_block,
    block_numel,
    CHUNK: tl.constexpr,
):
    # Grid: (num_copies, chunks per block). A block is one contiguous range of block_numel.
    copy_id = tl.program_id(0)
    offsets = tl.program_id(1).to(tl.int64) * CHUNK + tl.arange(0, CHUNK)
    mask = offsets < block_numel
    src_block_id = tl.load(src_ids_ptr + copy_id).to(tl.int64)
    dst_block_id = tl.load(dst_ids_ptr + copy_id).to(tl.int64)
    data = tl.load(kv_ptr + src_block_id * stride_block + offsets, mask=mask)
    tl.store(kv_ptr + dst_block_id * stride_block + offsets, data, mask=mask)


def copy_blocks(
    kv_cache: torch.Tensor,  # [num_blocks, ...], each block contiguous
    src_block_ids: Sequence[int] | torch.Tensor,
    dst_block_ids: Sequence[int] | torch.Tensor,
) -> None:
    """Copy block `src_block_ids[i]` onto block `dst_block_ids[i]` for every i, in one launch.

    Works on the whole cache (every layer of a block) or on one layer's view.
    """
    if len(src_block_ids) != len(dst_block_ids):
        raise ValueError("src_block_ids and dst_block_ids must have the same length")
    if len(src_block_ids) == 0:
        return
    is_host_list = not isinstance(src_block_ids, torch.Tensor)
    if is_host_list and not isinstance(dst_block_ids, torch.Tensor):
        # Checked only for host lists: on device tensors it would cost a synchronisation.
        dst_set = set(dst_block_ids)
        if len(dst_set) != len(dst_block_ids) or dst_set & set(src_block_ids):
            raise ValueError("destination blocks must be distinct and must not be sources")
    assert kv_cache[0].is_contiguous(), "each block must be one contiguous range"
    src = torch.as_tensor(src_block_ids, dtype=torch.int64).to(kv_cache.device)
    dst = torch.as_tensor(dst_block_ids, dtype=torch.int64).to(kv_cache.device)
    block_numel = kv_cache[0].numel()
    grid = (src.shape[0], triton.cdiv(block_numel, COPY_CHUNK))
    _copy_blocks_kernel[grid](
        kv_cache, src, dst, kv_cache.stride(0), block_numel, CHUNK=COPY_CHUNK, num_warps=4
    )

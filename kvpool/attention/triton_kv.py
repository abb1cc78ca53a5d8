"""Triton kernels that move KV data: writing a step's new K/V into their slots, and copying
whole blocks (copy-on-write, migration).

Layout (`kvpool.attention.backend`): a layer view is
`[num_blocks, 2, block_size, num_kv_heads, head_dim]`, strided across blocks; the whole cache is
`[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, in which each block is one
contiguous range. The kernels take strides, so they work on either; only the innermost
dimension must be contiguous.

Invariants the callers keep (checked on the host where that is free):
- `slot_mapping` holds one slot per new token, `block_id * block_size + offset`, all distinct.
- Block copies: destination ids are distinct and none of them is also a source, so the copies
  are independent and may run in any order, in parallel.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

COPY_CHUNK = 4096  # elements per program in the block copy: 8 KiB of bf16, 16 B per thread


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    kv_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kv_block,
    stride_kv_kv,
    stride_kv_slot,
    stride_kv_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
):
    # One program per new token: all of its heads, K and V, in one pass.
    token_id = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token_id).to(tl.int64)
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, BLOCK_HEADS)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [BLOCK_HEADS, BLOCK_D]

    key = tl.load(
        key_ptr + token_id * stride_key_token + heads[:, None] * stride_key_head + dims[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr
        + token_id * stride_value_token
        + heads[:, None] * stride_value_head
        + dims[None, :],
        mask=mask,
    )
    dst = kv_ptr + block_id * stride_kv_block + offset * stride_kv_slot
    dst = dst + heads[:, None] * stride_kv_head + dims[None, :]
    tl.store(dst, key.to(kv_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_kv_kv, value.to(kv_ptr.dtype.element_ty), mask=mask)


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


def write_kv(
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Store each new token's K and V at its slot (`kv[block, 0|1, offset]`); same contract as
    `kvpool.memory.kv_cache.write_kv`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, "key and value must have the same shape"
    assert kv_cache_layer.shape[3:] == (num_kv_heads, head_dim), "cache heads/dim mismatch"
    assert slot_mapping.shape == (num_tokens,), "one slot per new token"
    assert key.stride(2) == value.stride(2) == kv_cache_layer.stride(4) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache_layer,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *kv_cache_layer.stride()[:4],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache_layer.shape[2],
        num_warps=4,
    )


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

"""The KV write op: scatter a step's new K and V into their slots of one layer's cache view,
quantizing them (with a scale per row) when the cache holds int8 / fp8 codes. Its one home:

    check_write_kv      the contract, asserted by every path below before it writes
    write_kv_reference  PyTorch: the reference every kernel equals bit for bit
                        (tests/kernels/test_fused_ops.py, tests/attention/test_triton_kernels.py)
    write_kv            the C++ kernel (`kvpool/kernels/csrc/fused_ops.cpp`) where it serves the
                        tensors (CPU, a kernel dtype, built here), else the reference: the path
                        of the torch and cpu attention backends
    write_kv_triton     the Triton kernel (`triton_kv.write_kv_kernel`): the triton backend's path

Contract (`check_write_kv`):

    kv_cache_layer  [num_blocks, 2, block_size, num_kv_heads, head_dim]   (a strided view)
    key, value      [num_tokens, num_kv_heads, head_dim]
    slot_mapping    [num_tokens] int64, `block_id * block_size + offset`, all distinct;
                    `write_kv_triton` also skips a negative slot (`PAD_SLOT_ID`, a padded
                    token of a graphed decode), the other paths never see one
    kv_scales       [num_blocks, 2, block_size, num_kv_heads] float32, on the cache's device,
                    exactly when the cache's dtype is a quantized code (`kvpool.kernels.dtypes`)

Quantization is `kvpool.memory.kv_quant.quantize`: per row, `scale = amax(|row|) / qmax`.
Triton is imported only by `write_kv_triton`, so the CPU path never imports it.
"""

from __future__ import annotations

import torch

from kvpool.kernels import fused
from kvpool.kernels.dtypes import is_kv_code
from kvpool.memory.kv_quant import quantize


def check_write_kv(kv_cache_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None) -> None:
    """Assert the module docstring's contract (shapes, and scales exactly for codes)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, "key and value must have the same shape"
    assert kv_cache_layer.shape[3:] == (num_kv_heads, head_dim), "cache heads/dim mismatch"
    assert slot_mapping.shape == (num_tokens,), "one slot per new token"
    if not is_kv_code(kv_cache_layer.dtype):
        assert kv_scales is None, f"a {kv_cache_layer.dtype} KV cache has no scales"
        return
    assert kv_scales is not None, f"a {kv_cache_layer.dtype} KV cache needs kv_scales"
    assert kv_scales.shape == kv_cache_layer.shape[:4], "scales must be [blocks, 2, slots, heads]"
    assert kv_scales.dtype == torch.float32, f"scales must be float32, got {kv_scales.dtype}"
    assert kv_scales.device == kv_cache_layer.device, "scales live with their cache"


def write_kv_reference(
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
    kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads]
) -> None:
    """The op in PyTorch: one indexed write per plane (K, V); a quantized cache stores each
    row's codes and its scale."""
    block_size = kv_cache_layer.shape[2]
    block_ids = slot_mapping // block_size
    offsets = slot_mapping % block_size
    for plane, rows in ((0, key), (1, value)):
        if kv_scales is None:
            kv_cache_layer[block_ids, plane, offsets] = rows.to(kv_cache_layer.dtype)
            continue
        codes, scales = quantize(rows, kv_cache_layer.dtype)
        kv_cache_layer[block_ids, plane, offsets] = codes
        kv_scales[block_ids, plane, offsets] = scales


def write_kv(kv_cache_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """The op on any device: the C++ kernel where it serves the tensors, else the reference."""
    check_write_kv(kv_cache_layer, key, value, slot_mapping, kv_scales)
    if kv_scales is None:
        if fused.is_served(kv_cache_layer, key, value):
            torch.ops.kvpool_cpu.write_kv_(kv_cache_layer, key, value, slot_mapping)
            return
    elif fused.is_served(key, value) and kv_cache_layer.device.type == "cpu":
        torch.ops.kvpool_cpu.write_kv_quantized_(kv_cache_layer, kv_scales, key, value,
                                                 slot_mapping)
        return
    write_kv_reference(kv_cache_layer, key, value, slot_mapping, kv_scales)


def write_kv_triton(kv_cache_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> None:
    """The op by the Triton kernel (CUDA, or CPU tensors under TRITON_INTERPRET=1); inputs'
    innermost dimension must be contiguous (the scales' too)."""
    import triton

    from kvpool.attention.triton_kv import kv_quant_mode, scale_strides, write_kv_kernel
    from kvpool.kernels.dtypes import KV_QUANT_MAX

    check_write_kv(kv_cache_layer, key, value, slot_mapping, kv_scales)
    assert key.stride(2) == value.stride(2) == kv_cache_layer.stride(4) == 1
    num_tokens, num_kv_heads, head_dim = key.shape
    mode = kv_quant_mode(kv_cache_layer, kv_scales)
    if num_tokens == 0:
        return
    write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache_layer,
        kv_cache_layer if kv_scales is None else kv_scales,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        *kv_cache_layer.stride()[:4],
        *scale_strides(kv_scales),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=kv_cache_layer.shape[2],
        KV_QUANT=mode,
        QMAX=KV_QUANT_MAX[mode],
        num_warps=4,
    )

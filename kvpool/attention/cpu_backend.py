"""The CPU attention backend: the PyTorch reference, with decode attention done by a C++
kernel that reads K/V in place through the block tables (`kvpool/kernels/csrc/paged_decode.cpp`).

Decode attention dominates a CPU decode step once batches are large, and it is memory-bound:
the reference gathers every sequence's context into a padded copy and then reads the copy,
moving the context three times; the kernel reads it once, on torch's own threads. Prefill and
extend chunks (query_len > 1) keep the reference's one SDPA call each, where the matmuls
dominate. The kernel reads float32, bfloat16 and float16 caches in place (16-bit K/V are
widened as they are loaded; the arithmetic is float32), and quantized ones (int8 / fp8 codes
with `kv_scales`, `kvpool.memory.kv_quant`) too: codes are widened in registers and each row's
scale folds into its score (K) or its softmax weight (V), so no dequantized copy is made.
Inputs it does not cover (other dtypes or devices) take the reference path.

Sliding window (`sliding_window=W`, `kvpool.attention.backend`): the kernel starts each
sequence's walk at its window's first position, so the blocks before the window are never
read; prefill masks the window as the reference does. Soft-capped scores (`logit_softcap`) are
capped by the kernel too (a runtime float, 0: off), prefill by the reference.
"""

from __future__ import annotations

import torch

from kvpool.attention.metadata import AttentionMetadata
from kvpool.attention.torch_ref import TorchAttentionBackend
from kvpool.kernels.cpu_kernels import load_cpu_kernels
from kvpool.kernels.dtypes import is_kernel_float, is_kv_code


def paged_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim] float32, bfloat16 or float16
    kv_cache_layer: torch.Tensor,  # [num_blocks, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, each >= 1
    scale: float,
    kv_scales: torch.Tensor | None = None,  # [num_blocks, 2, block_size, num_kv_heads] float32
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """One decode query per sequence attending to its paged context, or to its last
    `sliding_window` positions (the C++ kernel), its scores soft-capped at `logit_softcap` if
    given; `kv_scales` exactly when the cache holds int8 / fp8 codes."""
    load_cpu_kernels()
    return torch.ops.kvpool_cpu.paged_decode(
        query, kv_cache_layer, block_tables, seq_lens, scale, kv_scales, sliding_window or 0,
        logit_softcap or 0.0,
    )


class CpuAttentionBackend(TorchAttentionBackend):
    """`AttentionBackend` for the CPU: in-place paged decode kernel plus the reference prefill."""

    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        load_cpu_kernels()  # fail at construction, not in the middle of a step

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
        # A float cache is read as it is; a quantized one (int8 / fp8 codes) with its scales.
        cache_served = (is_kernel_float(kv_cache_layer) if kv_scales is None
                        else is_kv_code(kv_cache_layer.dtype))
        if query.device.type != "cpu" or not is_kernel_float(query) or not cache_served:
            return super()._decode(query, kv_cache_layer, metadata, scale, kv_scales,
                                   sliding_window, logit_softcap)
        num_decode = query.shape[0]
        return paged_decode(
            query,
            kv_cache_layer,
            metadata.block_tables[:num_decode],
            metadata.seq_lens[:num_decode],
            scale,
            kv_scales,
            sliding_window,
            logit_softcap,
        )

"""Quantized KV storage: the reference quantizer, and what each `kv_cache_dtype` means.

The dtype facts (option names, sizes, largest codes) are `kvpool.memory.kv_layout`'s; this
module only reads them. `kv_cache_dtype` (vLLM's option name) picks the dtype the KV cache is
*stored* in:

    auto                 the model's dtype (no scales)
    float32 / bfloat16 / float16   that float dtype (no scales; 16-bit K/V are widened on load)
    int8                 symmetric int8, one float32 scale per (token, KV head), K and V apart
    fp8, fp8_e4m3        float8 e4m3 (the finite-only "fn" variant, max 448), scaled as int8
    fp8_e5m2             float8 e5m2 (max 57344), scaled as int8

Quantization is dynamic and needs no calibration: when a token's K (or V) row of one KV head
is written, its scale is `amax(|row|) / qmax` (1 for an all-zero row), and the stored code is
`round(row / scale)` (int8: round half to even, clamped to ±127; fp8: clamped to ±qmax, then
rounded to nearest even by the dtype conversion). Reading multiplies the code by its scale:
`row ≈ code * scale`.

Why one scale per (token, KV head) and not per (block, KV head): a block is written a token at
a time during decode, so a per-block scale is either fixed by the block's first token (later,
larger tokens clip) or forces the whole block to be requantized on every append (which changes
bytes a prefix-cache hit or a copy-on-write fork already shares). A per-token scale is written
once with its token and never changes, and its error is measured smaller
(`kvpool bench kv-granularity`, docs/memory.md). It costs 4 bytes per 64-element
row (6%), which `KVLayout.bytes_per_block` counts.

The functions here are the reference every kernel is tested against (the KV write's reference,
`kvpool.attention.kv_write.write_kv_reference`, quantizes with them).
"""

from __future__ import annotations

import torch

from kvpool.memory.kv_layout import QUANTIZED_CODE_MAX


def qmax(dtype: torch.dtype) -> float:
    return QUANTIZED_CODE_MAX[str(dtype).removeprefix("torch.")]


def quantize(rows: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` [..., head_dim] → (codes [..., head_dim] in `dtype`, scales [...] float32), one
    symmetric scale per row."""
    return encode(rows, scales_for(rows.float().abs().amax(dim=-1), dtype), dtype)


def scales_for(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps each `amax` onto the largest code of `dtype` (1 where amax is 0).

    Divided by a tensor of the same device, not a Python number: PyTorch on CUDA turns a
    division by a scalar into a multiplication by its reciprocal, which is off in the last bit
    for some values, while the Triton KV-write kernel divides exactly (IEEE)."""
    divisor = torch.full_like(amax, qmax(dtype))
    return torch.where(amax > 0, amax / divisor, torch.ones_like(amax))


def encode(rows: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows` [..., head_dim] as codes of `dtype` under the given `scales` [...]."""
    largest = qmax(dtype)
    scaled = rows.float() / scales[..., None]
    if dtype == torch.int8:
        return scaled.round().clamp(-largest, largest).to(torch.int8), scales
    return scaled.clamp(-largest, largest).to(dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim] and scales [...] → rows [..., head_dim] in `dtype`."""
    return (codes.float() * scales[..., None]).to(dtype)

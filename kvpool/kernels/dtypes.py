"""The one table of dtypes the kernels take, read by every kernel's Python side (the C++
fused ops and paged decode, the Triton KV, decode and prefill kernels) and the attention
backends that choose between them.

    FLOAT_DTYPES     activations and float KV caches: float32, bfloat16, float16 (the C++
                     kernels widen 16-bit values to float32 as they load them)
    KV_QUANT_MODES   the code dtypes of a quantized KV cache (int8, float8 e4m3fn and e5m2,
                     each with a float32 scale per row) → the kernels' `KV_QUANT` mode; a float
                     cache is `KV_QUANT_NONE`
    KV_QUANT_MAX     each mode's largest code, from the KV layout's `QUANTIZED_CODE_MAX` (the
                     owner of that fact, by dtype name)
"""

from __future__ import annotations

import torch

from kvpool.memory.kv_layout import QUANTIZED_CODE_MAX

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

KV_QUANT_NONE, KV_QUANT_INT8, KV_QUANT_E4M3, KV_QUANT_E5M2 = 0, 1, 2, 3
KV_QUANT_MODES = {
    torch.int8: KV_QUANT_INT8,
    torch.float8_e4m3fn: KV_QUANT_E4M3,
    torch.float8_e5m2: KV_QUANT_E5M2,
}
KV_QUANT_MAX = {KV_QUANT_NONE: 1.0} | {  # 1 for a float cache: never used
    mode: QUANTIZED_CODE_MAX[str(dtype).removeprefix("torch.")]
    for dtype, mode in KV_QUANT_MODES.items()
}


def is_kernel_float(*tensors: torch.Tensor) -> bool:
    """Whether every tensor has a float dtype the kernels take."""
    return all(tensor.dtype in FLOAT_DTYPES for tensor in tensors)


def is_kv_code(dtype: torch.dtype) -> bool:
    """Whether a KV cache of this dtype holds quantized codes (with scales)."""
    return dtype in KV_QUANT_MODES


def kv_quant_mode(dtype: torch.dtype) -> int:
    """The kernels' `KV_QUANT` for a KV cache of this dtype (`KV_QUANT_NONE`: a float one)."""
    return KV_QUANT_MODES.get(dtype, KV_QUANT_NONE)

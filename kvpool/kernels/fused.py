"""The model's fused elementwise ops: the C++ kernels on the CPU, PyTorch anywhere else.

Each op has a PyTorch formulation here (`*_reference`): it is what the model computed before the
ops were fused, the reference the C++ kernels (`csrc/fused_ops.cpp`) are tested against, and
the path for tensors the kernels do not serve (CUDA, or a CPU without the built extension). The
kernels round to the tensors' dtype exactly where the reference does, so both give the same
values (float32 up to summation order).

    rms_norm(x, weight, eps)              w * round(x * rsqrt(mean(x²) + eps))
    add_rms_norm_(x, residual, w, eps)    residual += x; x = rms_norm(residual)   (in place)
    silu_and_mul(x)                       silu(x[:, :I]) * x[:, I:]
    rotary_(x, positions, cos, sin)       "rotate half" rotation of q or k, in place

The KV write (`write_kv_`, `write_kv_quantized_` in the same C++ file) is dispatched, with its
reference and check, by `kvpool.attention.kv_write`, its one home.

`rotary_` has no fallback of its own: its reference is `kvpool.model.rope.apply_rotary`, and
`StepRotary` there picks the path once per step (`is_served`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kvpool.kernels.cpu_kernels import cpu_kernels_available
from kvpool.kernels.dtypes import FLOAT_DTYPES


@functools.cache
def _kernels_loaded() -> bool:
    return cpu_kernels_available()


def is_served(*tensors: torch.Tensor) -> bool:
    """Whether the C++ kernels take these tensors (CPU, a float dtype they know). One pass:
    it runs about 180 times a decode step (SmolLM2), ahead of every fused op."""
    return (all(t.device.type == "cpu" and t.dtype in FLOAT_DTYPES for t in tensors)
            and _kernels_loaded())


# ----------------------------------------------------------------- references
def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in float32, as the HuggingFace implementation does, then scale in x's dtype.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def silu_and_mul_reference(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * I] → gelu_tanh(x[:, :I]) * x[:, I:] (Gemma's gated MLP; no C++ kernel
    yet: PyTorch's own GELU)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# ------------------------------------------------------------------------ ops
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[num_tokens, hidden] → normalised and scaled, in x's dtype."""
    if x.dim() == 2 and is_served(x, weight):
        return torch.ops.kvpool_cpu.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> None:
    """In place: the residual stream takes `x` in, and `x` becomes its normalised value."""
    if x.dim() == 2 and is_served(x, residual, weight):
        torch.ops.kvpool_cpu.add_rms_norm_(x, residual, weight, eps)
        return
    residual.add_(x)
    x.copy_(rms_norm_reference(residual, weight, eps))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * intermediate] (gate, then up) → [num_tokens, intermediate]."""
    if x.dim() == 2 and is_served(x):
        return torch.ops.kvpool_cpu.silu_and_mul(x)
    return silu_and_mul_reference(x)


def rotary_(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> None:
    """Rotate `x` [num_tokens, num_heads, head_dim] in place by its tokens' `positions`, from
    float32 `cos`/`sin` tables [max_positions, head_dim] (rounded to x's dtype first). The C++
    kernel only: call it where `is_served(x)`."""
    torch.ops.kvpool_cpu.rotary_(x, positions, cos, sin)

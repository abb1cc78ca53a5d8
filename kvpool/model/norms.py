"""The RMSNorms of the decoder: over the hidden size (before and, in Gemma, after each
sublayer, and at the end), and over each query and key head (QK-norm: Qwen3, Gemma 3).

Both normalise in float32, as the HuggingFace implementations do, then scale in the model's
dtype; on the CPU one fused C++ op a call (`kvpool.kernels.fused`). Gemma's 1 + weight is
folded into the weight when it loads (`LlamaModel.load_weights`), so one kernel serves both.
"""

from __future__ import annotations

import torch
from torch import nn

from kvpool.kernels import fused
from kvpool.model.linear import empty_parameter


class RMSNorm(nn.Module):
    """Normalised in float32, as the HuggingFace implementation does, then scaled in the
    model's dtype (`kvpool.kernels.fused`: one fused op per call on the CPU)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.eps = eps
        self.weight = empty_parameter(size, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_(self, x: torch.Tensor, residual: torch.Tensor) -> None:
        """In place: `residual += x`, then `x = self(residual)`."""
        fused.add_rms_norm_(x, residual, self.weight, self.eps)


class HeadNorm(nn.Module):
    """RMSNorm over each head of q or k [num_tokens, num_heads, head_dim] (Qwen3's QK-norm):
    one weight of `head_dim` shared by the heads."""

    def __init__(self, head_dim: int, eps: float, dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.norm = RMSNorm(head_dim, eps, dtype, device)

    @property
    def weight(self) -> nn.Parameter:
        return self.norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.reshape(-1, x.shape[-1])).view(x.shape)  # rows: (token, head)

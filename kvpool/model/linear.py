"""`Linear`: y = x Wᵀ (+ b) for inference, with W laid out once for the CPU's oneDNN matmul.

`F.linear` on the CPU hands the plain `[out, in]` weight to the BLAS on every call, which
repacks it into the blocked layout its kernel reads, every time: for the small batches of a
decode step that repacking is most of the work. `pack()` does it once, at load
(`torch.ops.mkldnn._reorder_linear_weight`), and `forward` then calls oneDNN's matmul on the
packed weight (`torch.ops.mkldnn._linear_pointwise`, the op PyTorch's own CPU compiler emits).
oneDNN caches one matmul primitive per input shape, so a new batch size costs ~1 ms once.

Measured here (2 cores, SmolLM2-135M's five weight shapes, all 121 matmuls of a step):

    batch          1       4       32      64      256
    fp32 plain   25.5    54.1   125.4   201.8   620.5   ms
    fp32 packed  16.5    13.6    55.3    94.8   372.0   ms
    bf16 plain   17.0    21.5    36.0    72.7   203.7   ms
    bf16 packed   7.9     8.8    29.4    50.4   180.7   ms

Packing keeps fp32 results to rounding (oneDNN sums in another order: differences ~1e-6
relative), and the plain weight is released afterwards unless another module shares it (a
language-model head tied to the embedding table keeps the table). Where oneDNN cannot serve
(another device, dtype, or no bf16 support) the layer stays plain. `KVPOOL_PACKED_LINEARS=0`
keeps every layer plain (for A/B measurements).

A third form: `quantize()` gives the layer group-quantized weights (`kvpool.model.quantization`),
multiplied as they are stored by `kvpool.kernels.quant_matmul`; the float weight is released.
A layer holds exactly one of the three forms at a time: plain, packed or quantized.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from kvpool.kernels.quant_matmul import PackedWeight, quant_matmul, unpack

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# The batch size oneDNN is told to expect when it chooses the packed layout; any batch works.
_PACKING_BATCH_HINT = 64


def can_pack(weight: torch.Tensor) -> bool:
    """Whether oneDNN's packed matmul serves `weight` here."""
    if os.environ.get("KVPOOL_PACKED_LINEARS", "1") == "0":
        return False
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()



def empty_parameter(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    """A parameter allocated, not initialised (weights are loaded into it), never trained."""
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

class Linear(nn.Module):
    """`in_features` → `out_features`, bias optional; `weight` is a parameter until `pack`."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 dtype: torch.dtype, device: torch.device | str,
                 weight: nn.Parameter | None = None) -> None:
        """`weight`: share an existing `[out_features, in_features]` parameter (a tied head)."""
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        if weight is None:
            weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype,
                                              device=device), requires_grad=False)
            self._owns_weight = True
        else:
            assert tuple(weight.shape) == (out_features, in_features)
            self._owns_weight = False
        self.weight = weight
        self.bias = (nn.Parameter(torch.empty(out_features, dtype=dtype, device=device),
                                  requires_grad=False) if bias else None)
        self._packed: torch.Tensor | None = None  # oneDNN's layout of the weight, once packed
        self.quantized: PackedWeight | None = None  # the weight's quantized form, once given

    @property
    def is_packed(self) -> bool:
        return self._packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        if self.quantized is not None:
            out = quant_matmul(x, self.quantized)
            return out if self.bias is None else out.add_(self.bias)
        return F.linear(x, self.weight, self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the weight in the layer's dtype: a tied embedding's lookup (a packed
        layer cannot answer; a tied head is never packed). # [len(ids), in_features]"""
        if self.quantized is not None:
            # The released float weight keeps the layer's dtype.
            return unpack(self.quantized, ids).dequantize(self.weight.dtype)
        return F.embedding(ids, self.weight)

    @torch.no_grad()
    def quantize(self, weight: PackedWeight) -> None:
        """Hold `weight` (shared with a tied embedding, if any) instead of the float one."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"a quantized weight of shape {weight.shape} cannot replace "
                             f"{(self.out_features, self.in_features)}")
        self.quantized = weight
        self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)

    @torch.no_grad()
    def pack(self) -> bool:
        """Lay the weight out for oneDNN once (where it can serve); returns whether it did. The
        plain weight is released unless it is shared."""
        if self.quantized is not None:
            return False
        if self._packed is not None or not can_pack(self.weight):
            return self._packed is not None
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(),
                                                               _PACKING_BATCH_HINT)
        if self._owns_weight:
            self.weight = nn.Parameter(self.weight.new_empty(0), requires_grad=False)
        return True

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, packed={self.is_packed}, "
                f"quantized={self.quantized is not None}")

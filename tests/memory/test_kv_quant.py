"""`kv_quant.scales_for` divides exactly (IEEE float32 division), on every device this machine
has: the Triton KV-write kernel divides exactly, and its codes and scales are compared with
these bit for bit (tests/attention/test_triton_kernels.py). A division by a Python number
becomes a multiplication by its reciprocal on CUDA, off in the last bit for some rows."""

from __future__ import annotations

import pytest
import torch

from kvpool.memory.kv_quant import qmax, scales_for

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
QUANTIZED = [torch.int8] + ([torch.float8_e4m3fn] if hasattr(torch, "float8_e4m3fn") else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", QUANTIZED, ids=str)
def test_scales_are_the_exactly_rounded_quotient(device: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    exponents = torch.randint(-20, 20, (100_000,), generator=generator).float()
    amax = torch.rand(100_000, generator=generator) * torch.exp2(exponents)
    amax[:3] = torch.tensor([0.0, 1.0, 127.0])
    # float64 holds the float32 quotient's exact rounding (53 >= 2 * 24 + 2 bits).
    expected = torch.where(amax > 0, (amax.double() / qmax(dtype)).float(), 1.0)
    scales = scales_for(amax.to(device), dtype).cpu()
    assert torch.equal(scales, expected)

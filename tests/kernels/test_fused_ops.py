"""The fused C++ elementwise ops (`kvpool_cpu::*`) against their PyTorch references."""

from __future__ import annotations

import pytest
import torch

from kvpool.kernels import fused
from kvpool.kernels.cpu_kernels import cpu_kernels_available
from kvpool.memory.kv_cache import write_kv as write_kv_reference
from kvpool.model.rope import apply_rotary, cos_sin_cache

pytestmark = pytest.mark.skipif(not cpu_kernels_available(), reason="no C++ toolchain")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# float32 agrees up to summation order; 16-bit results may differ by one rounding step.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2),
             torch.float16: (2e-3, 1e-3)}


def _random(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).to(dtype)


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    rtol, atol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 37])  # a vector width multiple, and a ragged tail
def test_rms_norm_matches_reference(dtype, hidden):
    x, weight = _random(5, hidden, dtype=dtype), _random(hidden, dtype=dtype, seed=1)
    _close(torch.ops.kvpool_cpu.rms_norm(x, weight, 1e-5),
           fused.rms_norm_reference(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_and_normalises_it(dtype):
    x, residual = _random(7, 576, dtype=dtype), _random(7, 576, dtype=dtype, seed=1)
    weight = _random(576, dtype=dtype, seed=2)
    expected_residual = residual + x
    expected = fused.rms_norm_reference(expected_residual, weight, 1e-6)
    torch.ops.kvpool_cpu.add_rms_norm_(x, residual, weight, 1e-6)
    _close(residual, expected_residual)
    _close(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [1536, 19])
def test_silu_and_mul_matches_reference(dtype, intermediate):
    x = _random(3, 2 * intermediate, dtype=dtype) * 4  # reach silu's saturated tails
    _close(torch.ops.kvpool_cpu.silu_and_mul(x), fused.silu_and_mul_reference(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_the_rotate_half_reference(dtype):
    cos, sin = cos_sin_cache(64, 10000.0, 4096)
    positions = torch.tensor([0, 1, 17, 4095, 300])
    x = _random(5, 9, 64, dtype=dtype)
    rows = [table[positions].to(dtype).unsqueeze(1) for table in (cos, sin)]
    expected = apply_rotary(x, *rows)
    fused.rotary_(x, positions, cos, sin)
    _close(x, expected)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_fills_exactly_the_mapped_slots(dtype):
    layer = torch.zeros(6, 2, 16, 3, 64, dtype=dtype)
    key, value = _random(4, 3, 64, dtype=dtype), _random(4, 3, 64, dtype=dtype, seed=1)
    slots = torch.tensor([16, 17, 95, 40])  # blocks 1, 1, 5, 2
    expected = layer.clone()
    write_kv_reference(expected, key, value, slots)
    fused.write_kv_(layer, key, value, slots)
    assert torch.equal(layer, expected)


def test_ops_on_tensors_the_kernels_do_not_serve_use_the_reference():
    x = torch.randn(2, 8, dtype=torch.float64)
    weight = torch.ones(8, dtype=torch.float64)
    assert not fused.is_served(x)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-6),
                               fused.rms_norm_reference(x, weight, 1e-6))

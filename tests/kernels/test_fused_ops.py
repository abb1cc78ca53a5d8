"""The fused C++ elementwise ops (`kvpool_cpu::*`) against their PyTorch references."""

from __future__ import annotations

import pytest
import torch

from kvpool.attention import kv_write
from kvpool.attention.kv_write import write_kv_reference
from kvpool.kernels import fused
from kvpool.kernels.cpu_kernels import cpu_kernels_available
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
    kv_write.write_kv(layer, key, value, slots)
    assert torch.equal(layer, expected)


def _quantized_layer(code_dtype):
    """A zeroed layer view and its scale view (ones), strided across blocks as a KVCache's."""
    codes = torch.zeros(6, 2, 2, 16, 3, 80, dtype=code_dtype)  # [blocks, layers, K/V, S, Hkv, D]
    return codes[:, 1], torch.ones(6, 2, 2, 16, 3)[:, 1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("code_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_kv_quantized_stores_the_reference_codes_and_scales(code_dtype, dtype):
    num_tokens, head_dim = 40, 80
    # key and value are strided views into a fused qkv row, as the model passes them; rows of
    # very different magnitudes, one of them all zero (scale 1), one of int8 ties (scale 1:
    # its amax is 127, so row / scale is k + 0.5, which rounds to even).
    qkv = _random(num_tokens, 9, head_dim, dtype=torch.float32)
    qkv *= torch.logspace(-3, 3, num_tokens)[:, None, None]
    qkv[3, 6] = 0
    qkv[5, 6] = torch.arange(head_dim) - head_dim / 2 + 0.5
    qkv[5, 6, 0] = 127
    qkv = qkv.to(dtype)
    key, value = qkv[:, 6:], qkv[:, 3:6]
    slots = torch.randperm(6 * 16, generator=torch.Generator().manual_seed(2))[:num_tokens]
    layer, scales = _quantized_layer(code_dtype)
    expected, expected_scales = _quantized_layer(code_dtype)
    write_kv_reference(expected, key, value, slots, expected_scales)
    torch.ops.kvpool_cpu.write_kv_quantized_(layer, scales, key, value, slots)
    assert torch.equal(layer.view(torch.uint8), expected.view(torch.uint8))  # every code
    assert torch.equal(scales, expected_scales)  # bit for bit, unwritten slots still 1


def test_write_kv_with_scales_uses_the_kernel_where_served(monkeypatch):
    key, value = _random(4, 3, 80, dtype=torch.bfloat16), _random(4, 3, 80, dtype=torch.bfloat16)
    slots = torch.tensor([16, 17, 95, 40])
    layer, scales = _quantized_layer(torch.int8)
    expected, expected_scales = _quantized_layer(torch.int8)
    write_kv_reference(expected, key, value, slots, expected_scales)

    def no_reference(*args):
        raise AssertionError("the reference ran where the kernel serves")

    with monkeypatch.context() as patch:
        patch.setattr(kv_write, "write_kv_reference", no_reference)
        kv_write.write_kv(layer, key, value, slots, scales)
    assert torch.equal(layer, expected) and torch.equal(scales, expected_scales)
    layer, scales = _quantized_layer(torch.int8)  # float64 rows: not served, the reference
    kv_write.write_kv(layer, key.double(), value.double(), slots, scales)
    assert torch.equal(layer, expected) and torch.equal(scales, expected_scales)


def test_write_kv_quantized_rejects_bad_input_with_a_reason():
    key = value = _random(2, 3, 80, dtype=torch.float32)
    slots = torch.tensor([0, 1])
    layer, scales = _quantized_layer(torch.int8)
    with pytest.raises(RuntimeError, match="int8 and float8"):
        torch.ops.kvpool_cpu.write_kv_quantized_(layer.float(), scales, key, value, slots)
    with pytest.raises(RuntimeError, match="kv_scales must be float32"):
        torch.ops.kvpool_cpu.write_kv_quantized_(layer, scales[:, :, :8], key, value, slots)
    with pytest.raises(RuntimeError, match="slot out of range"):
        torch.ops.kvpool_cpu.write_kv_quantized_(layer, scales, key, value,
                                                 torch.tensor([0, 96]))


def test_ops_on_tensors_the_kernels_do_not_serve_use_the_reference():
    x = torch.randn(2, 8, dtype=torch.float64)
    weight = torch.ones(8, dtype=torch.float64)
    assert not fused.is_served(x)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-6),
                               fused.rms_norm_reference(x, weight, 1e-6))

"""Page-locked host memory of exactly the size asked for (CUDA only: pinning needs the driver)."""

from __future__ import annotations

import pytest
import torch

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.pinned import pinned_zeros
from kvpool.memory.tiers.host_tier import HostKVTier

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# 40 MiB and a bit: PyTorch's caching host allocator would lock 64 MiB for it.
ODD_SHAPE = (40 * 1024 * 1024 // 4 + 4099,)


def host_allocator_bytes() -> tuple[int, int]:
    """Bytes PyTorch's caching host allocator holds (rounded block sizes) and blocks it made."""
    stats = torch.cuda.host_memory_stats()
    return stats["allocated_bytes.current"], stats["num_host_alloc"]


@pytest.mark.gpu
@needs_cuda
def test_exactly_the_tensor_is_locked_and_round_trips_to_the_gpu():
    before = host_allocator_bytes()
    host = pinned_zeros(ODD_SHAPE, torch.float32)
    assert host.is_pinned() and host.numel() == ODD_SHAPE[0] and not host.any()
    assert host_allocator_bytes() == before  # nothing rounded up through the caching allocator
    device = torch.arange(ODD_SHAPE[0], dtype=torch.float32, device="cuda")
    host.copy_(device, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(host, device.cpu())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_pinned_host_tier_holds_exactly_its_budget(dtype):
    layout = KVLayout(block_size=16, num_layers=2, num_kv_heads=2, head_dim=64, dtype=dtype)
    budget = 37 * layout.bytes_per_block + 5
    before = host_allocator_bytes()
    tier = HostKVTier.for_budget(layout, budget, pin_memory=True)
    assert tier.kv_cache.nbytes <= budget
    assert tier.kv_cache.tensor.is_pinned()
    assert tier.kv_cache.scales is None or tier.kv_cache.scales.is_pinned()
    assert host_allocator_bytes() == before

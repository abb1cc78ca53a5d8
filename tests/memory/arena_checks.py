"""What the arena tests share: the devices they run on, and the checks every arena property
test makes (the engine's `Arena` in tests/memory, the simulator's `SizeClassArena` in
tests/sim). Imported as `tests.memory.arena_checks`."""

from __future__ import annotations

import math

import pytest
import torch

from kvpool.memory.arena import Arena, ArenaOutOfMemoryError, FreeRange
from kvpool.memory.arena_free_list import align_up

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ]),
]  # fmt: skip


def write_pattern(region: torch.Tensor, seed: int) -> torch.Tensor:
    """Fill `region` (uint8) with a pattern unique to `seed` and return a copy: a later
    mismatch shows that another allocation overlapped it."""
    pattern = ((torch.arange(region.numel()) * 31 + seed) % 256).to(torch.uint8)
    region.copy_(pattern)
    return pattern


def assert_no_free_range_fits(arena: Arena, error: ArenaOutOfMemoryError,
                              alignment: int | None) -> None:
    """A failed allocation was real: no free range holds the rounded request at an offset
    aligned to the request (and to the arena's 256-byte granule)."""
    step = math.lcm(alignment or 1, 256)
    for free_range in arena.free_ranges():
        assert align_up(free_range.offset, step) + error.num_rounded_bytes > free_range.end


def assert_arena_empty(arena: Arena, nbytes: int) -> None:
    """Quiescence: one free range spans the arena and nothing is allocated or wasted."""
    assert arena.free_ranges() == [FreeRange(0, nbytes)]
    stats = arena.stats()
    assert (stats.num_free_bytes, stats.num_allocated_bytes) == (nbytes, 0)
    assert stats.num_internal_waste_bytes == stats.num_live_allocations == 0

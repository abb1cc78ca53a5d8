"""The simulator's size-class arena on tiny buffers: class rounding and caches, flushing,
compaction with data (CPU, CUDA and the simulator's meta buffers), statistics and errors."""

from __future__ import annotations

import pytest
import torch

from kvpool.memory.arena import ArenaConfig, ArenaOutOfMemoryError, FreeRange
from kvpool.sim.size_class_arena import ClassedHandle, SizeClassArena, SizeClasses
from tests.memory.arena_checks import DEVICES

TINY = SizeClasses(sizes=(1024, 4096), large_granule=2048)



def make_arena(nbytes: int = 16384, device: str = "cpu", **config) -> SizeClassArena:
    buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    return SizeClassArena(buffer, ArenaConfig(**config), TINY)


def exact(arena: SizeClassArena, nbytes: int, **kwargs) -> ClassedHandle:
    return arena.allocate(nbytes, size_class=False, **kwargs)


def data(arena: SizeClassArena, handle: ClassedHandle) -> torch.Tensor:
    return arena.buffer[handle.offset : handle.offset + handle.nbytes]


def fill(arena: SizeClassArena, handle: ClassedHandle, seed: int) -> torch.Tensor:
    pattern = ((torch.arange(handle.nbytes) * 7 + seed) % 256).to(torch.uint8)
    data(arena, handle).copy_(pattern)
    return pattern


def test_size_classes_round_and_count_waste() -> None:
    arena = make_arena()
    small, medium, large = arena.allocate(300), arena.allocate(1025), arena.allocate(5000)
    assert (small.range_nbytes, medium.range_nbytes, large.range_nbytes) == (1024, 4096, 6144)
    assert (small.size_class, medium.size_class, large.size_class) == (1024, 4096, 6144)
    stats = arena.stats()
    assert stats.num_allocated_bytes == 300 + 1025 + 5000
    assert stats.num_internal_waste_bytes == (1024 - 300) + (4096 - 1025) + (6144 - 5000)
    assert stats.num_free_bytes == 16384 - 1024 - 4096 - 6144
    assert exact(arena, 300).size_class is None
    arena.check_invariants()


def test_class_cache_is_reused_lifo_before_new_space_is_carved() -> None:
    arena = make_arena()
    first, second = arena.allocate(300), arena.allocate(1000)
    assert (first.offset, second.offset) == (0, 1024)
    arena.free(first)
    arena.free(second)
    assert arena.free_ranges() == [FreeRange(2048, 14336)]  # cached ranges stay out
    assert arena.cached_ranges() == [FreeRange(0, 1024), FreeRange(1024, 1024)]
    assert arena.class_stats().num_cached_bytes == 2048
    stats = arena.stats()  # cached bytes are free; the largest free piece is the free tail
    assert (stats.num_free_bytes, stats.largest_free_range_bytes) == (16384, 14336)
    arena.check_invariants()
    assert arena.allocate(700).offset == 1024  # most recently freed first
    assert arena.allocate(1).offset == 0
    assert arena.allocate(512).offset == 2048  # cache empty: carved
    assert arena.class_stats().cache_hits == {1024: 2}


def test_a_cached_range_is_reused_only_where_it_is_aligned() -> None:
    arena = make_arena()
    arena.allocate(1024)
    misaligned = arena.allocate(1024)  # at 1024
    arena.free(misaligned)
    assert arena.allocate(1024, alignment=2048).offset == 2048  # carved, the cache skipped
    assert arena.cached_ranges() == [FreeRange(1024, 1024)]


def test_cached_ranges_are_flushed_and_coalesced_when_nothing_else_fits() -> None:
    arena = make_arena(4096)
    handles = [arena.allocate(1024) for _ in range(4)]
    for handle in handles:
        arena.free(handle)
    assert arena.free_ranges() == []
    whole = exact(arena, 4096)
    assert whole.offset == 0
    assert arena.class_stats().num_cached_bytes == 0
    assert arena.release_cached() == 0
    arena.check_invariants()


def test_compact_slides_relocatable_allocations_around_pinned_ones() -> None:
    arena = make_arena(8192)
    a, b = exact(arena, 1024, relocatable=True), exact(arena, 1024, relocatable=True)
    pinned = exact(arena, 512)
    c = exact(arena, 2048, relocatable=True)
    d = exact(arena, 512, relocatable=True)
    patterns = {id(h): fill(arena, h, seed) for seed, h in enumerate((b, pinned, c, d))}
    arena.free(a)
    report = arena.compact()
    assert (b.offset, pinned.offset, c.offset, d.offset) == (0, 2048, 2560, 4608)
    assert (report.num_moved, report.num_bytes_moved) == (1, 1024)  # only b: c, d sat tight
    arena.free(pinned)
    report = arena.compact()
    assert (b.offset, c.offset, d.offset) == (0, 1024, 3072)
    assert (report.num_moved, report.num_bytes_moved) == (2, 2560)
    assert arena.free_ranges() == [FreeRange(3584, 8192 - 3584)]
    assert [h.offset for h in arena.live_handles()] == [0, 1024, 3072]
    for handle in (b, c, d):
        assert torch.equal(data(arena, handle), patterns[id(handle)])
    assert (arena.class_stats().num_compactions, arena.class_stats().num_bytes_moved) == (
        2, 3584
    )
    arena.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbytes", [2048, 8192])  # direct pieces, and staged pieces
def test_overlapping_moves_keep_the_data(nbytes: int, device: str) -> None:
    arena = make_arena(16384, device)
    gap = exact(arena, 256)
    mover = exact(arena, nbytes, relocatable=True)
    pattern = fill(arena, mover, seed=3)
    arena.free(gap)
    arena.compact()
    assert mover.offset == 0
    assert torch.equal(data(arena, mover).cpu(), pattern.cpu())


def test_a_meta_buffer_compacts_its_bookkeeping_only() -> None:
    arena = SizeClassArena(torch.empty(1 << 30, dtype=torch.uint8, device="meta"))
    gap = exact(arena, 1 << 20)
    mover = exact(arena, 512 << 20, relocatable=True)
    arena.free(gap)
    assert arena.compact().num_bytes_moved == 512 << 20
    assert mover.offset == 0
    assert arena.classes == SizeClasses()  # the seed's classes by default


def test_failed_allocation_compacts_when_total_free_would_suffice() -> None:
    arena = make_arena(4096)
    handles = [exact(arena, 1024, relocatable=True) for _ in range(4)]
    pattern = fill(arena, handles[3], seed=9)
    arena.free(handles[0])
    arena.free(handles[2])
    big = exact(arena, 2048)
    assert big.offset == 2048
    assert (handles[1].offset, handles[3].offset) == (0, 1024)
    assert torch.equal(data(arena, handles[3]), pattern)
    assert arena.class_stats().num_compactions == 1


def test_out_of_memory_after_flushing_when_compaction_cannot_help() -> None:
    arena = make_arena(4096)
    handles = [exact(arena, 1024) for _ in range(3)]  # pinned: compaction cannot help
    cached = arena.allocate(1024)
    arena.free(handles[0])
    arena.free(cached)
    with pytest.raises(ArenaOutOfMemoryError) as caught:
        exact(arena, 1500)
    assert "free in total 2.00 KiB (2048 B)" in str(caught.value)
    assert "largest free range 1.00 KiB (1024 B)" in str(caught.value)
    assert arena.class_stats().num_cached_bytes == 0  # the cache was flushed trying
    assert arena.class_stats().num_compactions == 0
    arena.check_invariants()


def test_size_classes_defaults_and_validation() -> None:
    classes = SizeClasses()
    assert classes.sizes == (256 << 10, 1 << 20, 4 << 20, 16 << 20)
    assert classes.class_nbytes(300 << 10) == 1 << 20
    assert classes.class_nbytes(17 << 20) == 18 << 20  # past the classes: 2 MiB granules
    assert TINY.class_nbytes(4097) == 6144
    with pytest.raises(ValueError, match="increasing"):
        SizeClasses(sizes=(4096, 1024))
    with pytest.raises(ValueError, match="positive"):
        SizeClasses(sizes=(1024,), large_granule=0)
    with pytest.raises(ValueError, match="multiple of 256"):
        SizeClassArena(torch.zeros(4096, dtype=torch.uint8), None, SizeClasses((1000,), 1024))

"""Arena unit tests on tiny arenas: exact offsets per policy, splitting, coalescing, class
caches, compaction with data, statistics and the out-of-memory message."""

from __future__ import annotations

import pytest
import torch

from kvpool.memory.arena import Arena, ArenaHandle
from kvpool.memory.arena_free_list import FreeRange, PlacementPolicy
from kvpool.memory.arena_policy import ArenaConfig
from kvpool.memory.arena_stats import ArenaOutOfMemoryError, format_bytes

TINY = ArenaConfig(size_classes=(1024, 4096), large_granule=2048)


DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[
        pytest.mark.gpu,
        pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ]),
]


def make_arena(nbytes: int = 16384, device: str = "cpu", **overrides) -> Arena:
    config = ArenaConfig(**{"size_classes": (1024, 4096), "large_granule": 2048, **overrides})
    return Arena(torch.zeros(nbytes, dtype=torch.uint8, device=device), config)


def exact(arena: Arena, nbytes: int, **kwargs) -> ArenaHandle:
    return arena.allocate(nbytes, size_class=False, **kwargs)


def fill(handle: ArenaHandle, seed: int) -> torch.Tensor:
    pattern = ((torch.arange(handle.nbytes) * 7 + seed) % 256).to(torch.uint8)
    handle.view(torch.uint8).copy_(pattern)
    return pattern


def read(handle: ArenaHandle) -> torch.Tensor:
    return handle.view(torch.uint8).cpu()


def holes_arena(policy: str) -> Arena:
    """Free ranges [256, 2304) 2048 B, [2560, 3584) 1024 B, [3840, 16384) 12544 B."""
    arena = make_arena(policy=policy)
    sizes = [256, 2048, 256, 1024, 256]
    handles = [exact(arena, size) for size in sizes]
    assert [h.offset for h in handles] == [0, 256, 2304, 2560, 3584]
    arena.free(handles[1])
    arena.free(handles[3])
    return arena


@pytest.mark.parametrize(
    ("policy", "expected_offset"), [("first", 256), ("best", 2560), ("worst", 3840)]
)
def test_placement_policies_pick_exact_offsets(policy: str, expected_offset: int) -> None:
    arena = holes_arena(policy)
    handle = exact(arena, 768)
    assert handle.offset == expected_offset
    arena.check_invariants()


def test_split_keeps_front_placement_and_leaves_the_remainder_free() -> None:
    arena = holes_arena("best")
    exact(arena, 768)  # front of the 1024 B hole at 2560
    assert arena.free_ranges() == [
        FreeRange(256, 2048), FreeRange(3328, 256), FreeRange(3840, 12544)
    ]


def test_alignment_padding_stays_free_and_block_alignment_need_not_be_a_power_of_two() -> None:
    arena = make_arena(policy="first")
    exact(arena, 256)
    aligned = exact(arena, 512, alignment=1024)
    assert aligned.offset == 1024
    assert arena.free_ranges()[0] == FreeRange(256, 768)
    block_nbytes = 768  # a KV segment of 2 blocks: offset must be a whole number of blocks
    segment = exact(arena, 2 * block_nbytes, alignment=block_nbytes)
    assert segment.offset == 1536 and segment.offset % block_nbytes == 0
    assert segment.alignment == 768
    arena.check_invariants()


def test_free_neighbours_coalesce_at_once() -> None:
    arena = make_arena(4096)
    left, middle, right, last = (exact(arena, 1024) for _ in range(4))
    arena.free(middle)
    assert arena.free_ranges() == [FreeRange(1024, 1024)]
    arena.free(left)
    assert arena.free_ranges() == [FreeRange(0, 2048)]
    arena.free(last)
    assert arena.free_ranges() == [FreeRange(0, 2048), FreeRange(3072, 1024)]
    arena.free(right)
    assert arena.free_ranges() == [FreeRange(0, 4096)]


def test_size_classes_round_and_count_waste() -> None:
    arena = make_arena()
    small, medium, large = arena.allocate(300), arena.allocate(1025), arena.allocate(5000)
    assert (small.range_nbytes, medium.range_nbytes, large.range_nbytes) == (1024, 4096, 6144)
    assert (small.size_class, medium.size_class, large.size_class) == (1024, 4096, 6144)
    stats = arena.stats()
    assert stats.num_allocated_bytes == 300 + 1025 + 5000
    assert stats.num_internal_waste_bytes == (1024 - 300) + (4096 - 1025) + (6144 - 5000)
    assert stats.num_free_bytes == 16384 - 1024 - 4096 - 6144


def test_class_cache_is_reused_lifo_before_new_space_is_carved() -> None:
    arena = make_arena()
    first, second = arena.allocate(300), arena.allocate(1000)
    assert (first.offset, second.offset) == (0, 1024)
    arena.free(first)
    arena.free(second)
    assert arena.free_ranges() == [FreeRange(2048, 14336)]  # cached ranges stay out
    assert arena.cached_ranges() == [FreeRange(0, 1024), FreeRange(1024, 1024)]
    assert arena.stats().num_cached_bytes == 2048
    assert arena.allocate(700).offset == 1024  # most recently freed first
    assert arena.allocate(1).offset == 0
    assert arena.allocate(512).offset == 2048  # cache empty: carved
    assert arena.stats().cache_hits == {1024: 2}


def test_cached_ranges_are_flushed_and_coalesced_when_nothing_else_fits() -> None:
    arena = make_arena(4096)
    handles = [arena.allocate(1024) for _ in range(4)]
    for handle in handles:
        arena.free(handle)
    assert arena.free_ranges() == []
    whole = exact(arena, 4096)
    assert whole.offset == 0
    assert arena.stats().num_cached_bytes == 0
    arena.check_invariants()


def test_compact_slides_relocatable_allocations_and_tells_their_owners() -> None:
    arena = make_arena(8192)
    moves: list[tuple[int, int]] = []

    def on_move(handle: ArenaHandle, old: int, new: int) -> None:
        moves.append((old, new))

    a, b = exact(arena, 1024, relocatable=True), exact(arena, 1024, relocatable=True)
    pinned = exact(arena, 512)
    c = exact(arena, 2048, relocatable=True, on_move=on_move)
    d = exact(arena, 512, relocatable=True, on_move=on_move)
    patterns = {id(h): fill(h, seed) for seed, h in enumerate((b, pinned, c, d))}
    arena.free(a)
    report = arena.compact()
    assert (b.offset, pinned.offset, c.offset, d.offset) == (0, 2048, 2560, 4608)
    assert moves == []  # c and d already sat right after the pinned allocation
    assert (report.num_moved, report.num_bytes_moved) == (1, 1024)
    arena.free(pinned)
    report = arena.compact()
    assert (b.offset, c.offset, d.offset) == (0, 1024, 3072)
    assert moves == [(2560, 1024), (4608, 3072)]
    assert arena.free_ranges() == [FreeRange(3584, 8192 - 3584)]
    for handle in (b, c, d):
        assert torch.equal(read(handle), patterns[id(handle)])
    assert arena.stats().num_compactions == 2
    arena.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nbytes", [2048, 8192])  # direct pieces, and staged pieces
def test_overlapping_moves_keep_the_data(nbytes: int, device: str) -> None:
    arena = make_arena(16384, device)
    gap = exact(arena, 256)
    mover = exact(arena, nbytes, relocatable=True)
    pattern = fill(mover, seed=3)
    arena.free(gap)
    arena.compact()
    assert mover.offset == 0
    assert torch.equal(read(mover), pattern)


def test_failed_allocation_compacts_when_total_free_would_suffice() -> None:
    arena = make_arena(4096)
    handles = [exact(arena, 1024, relocatable=True) for _ in range(4)]
    pattern = fill(handles[3], seed=9)
    arena.free(handles[0])
    arena.free(handles[2])
    big = exact(arena, 2048)
    assert big.offset == 2048
    assert (handles[1].offset, handles[3].offset) == (0, 1024)
    assert torch.equal(read(handles[3]), pattern)
    assert arena.stats().num_compactions == 1


def test_out_of_memory_message_states_the_numbers() -> None:
    arena = make_arena(4096)
    handles = [exact(arena, 1024) for _ in range(4)]  # pinned: compaction cannot help
    arena.free(handles[0])
    arena.free(handles[2])
    with pytest.raises(ArenaOutOfMemoryError) as caught:
        exact(arena, 1500)
    message = str(caught.value)
    assert "asked for 1.46 KiB (1500 B)" in message
    assert "(1.50 KiB (1536 B) after rounding, alignment 256 B)" in message
    assert "free in total 2.00 KiB (2048 B)" in message
    assert "largest free range 1.00 KiB (1024 B)" in message
    assert "external fragmentation 50.0%" in message
    error = caught.value
    assert (error.num_free_bytes, error.largest_free_bytes) == (2048, 1024)
    assert error.fragmentation == 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_views_are_typed_shaped_and_share_the_buffer(device: str) -> None:
    arena = make_arena(device=device)
    handle = arena.allocate(512, dtype=torch.float16, shape=(4, 64))
    assert handle.tensor.shape == (4, 64) and handle.tensor.dtype == torch.float16
    assert handle.tensor.device.type == device
    handle.tensor.fill_(1.0)
    one_fp16 = torch.tensor([1.0], dtype=torch.float16).view(torch.uint8)
    assert torch.equal(arena.buffer[0:2].cpu(), one_fp16)
    assert handle.view(torch.float32, (2, 64)).shape == (2, 64)
    assert handle.view(torch.uint8).shape == (512,)


def test_stats_track_counters_and_fragmentation() -> None:
    arena = make_arena(4096)
    handles = [exact(arena, 1024) for _ in range(4)]
    arena.free(handles[1])
    arena.free(handles[3])
    stats = arena.stats()
    assert (stats.num_allocations, stats.num_frees, stats.num_live_allocations) == (4, 2, 2)
    assert (stats.num_free_bytes, stats.largest_free_range_bytes, stats.num_free_ranges) == (
        2048, 1024, 2
    )
    assert stats.external_fragmentation == 0.5
    assert stats.num_allocated_bytes + stats.num_free_bytes == stats.num_reserved_bytes == 4096


def test_bad_requests_raise_value_errors() -> None:
    arena = make_arena()
    with pytest.raises(ValueError, match="positive"):
        arena.allocate(0)
    with pytest.raises(ValueError, match="shape"):
        arena.allocate(100, dtype=torch.float32, shape=(2, 2))
    with pytest.raises(ValueError, match="whole number"):
        arena.allocate(6, dtype=torch.float32)
    with pytest.raises(ValueError, match="alignment must be >= 1"):
        arena.allocate(64, alignment=-512)
    handle = arena.allocate(64)
    arena.free(handle)
    with pytest.raises(ValueError, match="live allocation"):
        arena.free(handle)
    with pytest.raises(ValueError, match="freed"):
        handle.view(torch.uint8)
    with pytest.raises(ValueError, match="alignment"):
        ArenaConfig(alignment=128)
    with pytest.raises(ValueError, match="increasing"):
        ArenaConfig(size_classes=(4096, 1024))
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        Arena(torch.zeros(4, 4, dtype=torch.uint8))


def test_config_accepts_policy_names_and_default_classes() -> None:
    assert ArenaConfig(policy="worst").policy is PlacementPolicy.WORST_FIT
    config = ArenaConfig()
    assert config.size_classes == (256 << 10, 1 << 20, 4 << 20, 16 << 20)
    assert config.class_nbytes(300 << 10) == 1 << 20
    assert config.class_nbytes(17 << 20) == 18 << 20  # past the classes: 2 MiB granules
    assert TINY.class_nbytes(4097) == 6144
    assert format_bytes(1536) == "1.50 KiB (1536 B)"

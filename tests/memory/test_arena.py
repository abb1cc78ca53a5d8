"""The engine's arena on tiny buffers: exact offsets per policy, splitting, alignment,
coalescing, statistics, reservation and the out-of-memory message.

(Size classes, class caches and compaction are the simulator's: tests/sim/test_size_class_arena.py.)
"""

from __future__ import annotations

import pytest
import torch

from kvpool.memory.arena import (
    Arena,
    ArenaConfig,
    ArenaHandle,
    ArenaOutOfMemoryError,
    FreeRange,
    PlacementPolicy,
)
from kvpool.memory.arena_stats import format_bytes
from tests.memory.arena_checks import DEVICES


def make_arena(nbytes: int = 16384, device: str = "cpu", **config) -> Arena:
    return Arena(torch.zeros(nbytes, dtype=torch.uint8, device=device), ArenaConfig(**config))


def holes_arena(policy: str) -> Arena:
    """Free ranges [256, 2304) 2048 B, [2560, 3584) 1024 B, [3840, 16384) 12544 B."""
    arena = make_arena(policy=policy)
    sizes = [256, 2048, 256, 1024, 256]
    handles = [arena.allocate(size) for size in sizes]
    assert [h.offset for h in handles] == [0, 256, 2304, 2560, 3584]
    arena.free(handles[1])
    arena.free(handles[3])
    return arena


@pytest.mark.parametrize(
    ("policy", "expected_offset"), [("first", 256), ("best", 2560), ("worst", 3840)]
)
def test_placement_policies_pick_exact_offsets(policy: str, expected_offset: int) -> None:
    arena = holes_arena(policy)
    handle = arena.allocate(768)
    assert handle.offset == expected_offset
    arena.check_invariants()


def test_split_keeps_front_placement_and_leaves_the_remainder_free() -> None:
    arena = holes_arena("best")
    arena.allocate(768)  # front of the 1024 B hole at 2560
    assert arena.free_ranges() == [
        FreeRange(256, 2048), FreeRange(3328, 256), FreeRange(3840, 12544)
    ]


def test_alignment_padding_stays_free_and_block_alignment_need_not_be_a_power_of_two() -> None:
    arena = make_arena(policy="first")
    arena.allocate(256)
    aligned = arena.allocate(512, alignment=1024)
    assert aligned.offset == 1024
    assert arena.free_ranges()[0] == FreeRange(256, 768)
    block_nbytes = 768  # a KV segment of 2 blocks: offset must be a whole number of blocks
    segment = arena.allocate(2 * block_nbytes, alignment=block_nbytes)
    assert segment.offset == 1536 and segment.offset % block_nbytes == 0
    assert segment.alignment == 768
    odd = arena.allocate(256, alignment=100)  # lcm(100, 256) = 6400
    assert (odd.offset, odd.alignment) == (6400, 6400)
    arena.check_invariants()


def test_sizes_round_to_the_base_alignment_and_the_rounding_is_counted_as_waste() -> None:
    arena = make_arena(4096, alignment=512)
    small, exact = arena.allocate(300), arena.allocate(1024)
    assert (small.offset, small.range_nbytes, small.end) == (0, 512, 512)
    assert (exact.offset, exact.range_nbytes) == (512, 1024)
    stats = arena.stats()
    assert (stats.num_allocated_bytes, stats.num_internal_waste_bytes) == (1324, 212)
    assert stats.num_free_bytes == 4096 - 1536


def test_free_neighbours_coalesce_at_once() -> None:
    arena = make_arena(4096)
    left, middle, right, last = (arena.allocate(1024) for _ in range(4))
    arena.free(middle)
    assert arena.free_ranges() == [FreeRange(1024, 1024)]
    arena.free(left)
    assert arena.free_ranges() == [FreeRange(0, 2048)]
    arena.free(last)
    assert arena.free_ranges() == [FreeRange(0, 2048), FreeRange(3072, 1024)]
    arena.free(right)
    assert arena.free_ranges() == [FreeRange(0, 4096)]
    assert arena.free_ranges()[0].end == 4096


def test_live_handles_are_in_offset_order_and_freed_handles_are_dead() -> None:
    arena = make_arena(4096)
    handles = [arena.allocate(1024) for _ in range(3)]
    arena.free(handles[0])
    again = arena.allocate(512)  # best fit: the 1024 B hole at 0, not the 1024 B tail
    assert again.offset == 0
    assert arena.live_handles() == [again, handles[1], handles[2]]
    assert not handles[0].is_live and all(h.is_live for h in arena.live_handles())


def test_out_of_memory_message_states_the_numbers() -> None:
    arena = make_arena(4096)
    handles = [arena.allocate(1024) for _ in range(4)]
    arena.free(handles[0])
    arena.free(handles[2])
    with pytest.raises(ArenaOutOfMemoryError) as caught:
        arena.allocate(1500)
    message = str(caught.value)
    assert "asked for 1.46 KiB (1500 B)" in message
    assert "(1.50 KiB (1536 B) after rounding, alignment 256 B)" in message
    assert "free in total 2.00 KiB (2048 B)" in message
    assert "largest free range 1.00 KiB (1024 B)" in message
    assert "external fragmentation 50.0%" in message
    error = caught.value
    assert (error.num_free_bytes, error.largest_free_bytes) == (2048, 1024)
    assert (error.num_requested_bytes, error.num_rounded_bytes) == (1500, 1536)
    assert error.fragmentation == 0.5
    arena.check_invariants()  # a failed request changes nothing
    assert arena.stats().num_allocations == 4


def test_stats_track_counters_and_fragmentation() -> None:
    arena = make_arena(4096)
    handles = [arena.allocate(1024) for _ in range(4)]
    arena.free(handles[1])
    arena.free(handles[3])
    stats = arena.stats()
    assert (stats.num_allocations, stats.num_frees, stats.num_live_allocations) == (4, 2, 2)
    assert (stats.num_free_bytes, stats.largest_free_range_bytes, stats.num_free_ranges) == (
        2048, 1024, 2
    )
    assert stats.external_fragmentation == 0.5
    assert stats.num_allocated_bytes + stats.num_free_bytes == stats.num_reserved_bytes == 4096
    arena.free(handles[0])
    arena.free(handles[2])
    assert arena.stats().external_fragmentation == 0.0


@pytest.mark.parametrize("device", DEVICES)
def test_reserve_makes_one_buffer_whose_ranges_are_the_handles_bytes(device: str) -> None:
    arena = Arena.reserve(1000, device)  # 1000 B: 768 usable at the 256 B base alignment
    assert arena.buffer.device.type == device and arena.buffer.dtype == torch.uint8
    assert (arena.buffer.numel(), arena.num_reserved_bytes) == (1000, 768)
    first, second = arena.allocate(256), arena.allocate(512)
    arena.buffer[first.offset : first.offset + first.nbytes].fill_(3)
    arena.buffer[second.offset : second.offset + second.nbytes].fill_(7)
    assert torch.all(arena.buffer[:256] == 3) and torch.all(arena.buffer[256:768] == 7)
    with pytest.raises(ArenaOutOfMemoryError):
        arena.allocate(1)


def test_bad_requests_raise_value_errors() -> None:
    arena = make_arena()
    with pytest.raises(ValueError, match="positive"):
        arena.allocate(0)
    with pytest.raises(ValueError, match="alignment must be >= 1"):
        arena.allocate(64, alignment=-512)
    handle = arena.allocate(64)
    arena.free(handle)
    with pytest.raises(ValueError, match="live allocation"):
        arena.free(handle)
    with pytest.raises(ValueError, match="live allocation"):
        arena.free(ArenaHandle(0, 64, 256, 256))  # foreign: not this arena's handle
    with pytest.raises(ValueError, match="alignment"):
        ArenaConfig(alignment=128)
    with pytest.raises(ValueError, match="contiguous 1-D uint8"):
        Arena(torch.zeros(4, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="positive size"):
        Arena.reserve(0)
    assert arena.stats().num_live_allocations == 0


def test_config_accepts_policy_names() -> None:
    assert ArenaConfig(policy="worst").policy is PlacementPolicy.WORST_FIT
    assert ArenaConfig().policy is PlacementPolicy.BEST_FIT and ArenaConfig().alignment == 256
    assert format_bytes(1536) == "1.50 KiB (1536 B)"
    assert format_bytes(3 << 30) == "3.00 GiB (3221225472 B)"

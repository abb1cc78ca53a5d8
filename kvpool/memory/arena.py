"""The arena: exact, aligned byte ranges of one buffer reserved once, for the engine's KV pool.

The buffer is reserved once (any device); after that, allocating and freeing is bookkeeping in
Python and never calls the device allocator. `FreeList` (arena_free_list.py) knows which bytes
are free and where a request goes under the placement policy; this module adds handles,
alignment, statistics (arena_stats.py) and the out-of-memory error.

The engine takes KV segments from it (kvpool/engine/setup.py, kvpool/memory/elastic_pool.py):
one exact range of N blocks, aligned to a block's size, so a segment's offset is a whole number
of blocks and `block id = offset / bytes_per_block`. Nothing else lives in the arena.

Allocation (`allocate`):
 1. Round the size up to the base alignment (`ArenaConfig.alignment`, a power of two >= 256).
    The effective alignment of a request is the least common multiple of its `alignment`
    argument and the base, so it need not be a power of two (a KV block rarely is).
 2. Pick a free range under the placement policy: first, best or worst fit (see
    arena_free_list.py; ties go to the lowest offset, so placement is deterministic).
 3. Splitting rule: the allocation takes the chosen range at its first suitably aligned
    offset; the padding before it and the remainder after it stay free. Offsets and sizes are
    multiples of the base alignment, so no leftover sliver is smaller than 256 bytes.
 4. If nothing fits, `_recover` may make room (the base arena cannot: it never moves data;
    kvpool/sim/size_class_arena.py flushes caches and compacts there); then
    `ArenaOutOfMemoryError` says what was asked, what is free, and how fragmented it is.

Freeing returns the range to the free list, where it merges with its free neighbours at once.

Invariants (checked by `check_invariants`): live and free ranges are disjoint and tile
`[0, num_reserved_bytes)` (bytes are conserved, nothing overlaps); every live offset is a
multiple of its alignment; free-list ranges never touch.

Subclasses (the simulator's size-class arena) reuse `_carve`, `_register`, `_release` and the
`_live` / `_free_list` state, and extend `_recover` and `_unused_ranges`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.memory.arena_free_list import FreeList, FreeRange, PlacementPolicy, align_up
from kvpool.memory.arena_stats import ArenaOutOfMemoryError, ArenaStats, external_fragmentation

if TYPE_CHECKING:
    import torch

__all__ = [
    "Arena",
    "ArenaConfig",
    "ArenaHandle",
    "ArenaOutOfMemoryError",
    "ArenaStats",
    "FreeRange",
    "PlacementPolicy",
]

BASE_ALIGNMENT = 256


@dataclass(frozen=True, slots=True)
class ArenaConfig:
    """Base alignment (a power of two >= 256) and placement policy of an arena."""

    alignment: int = BASE_ALIGNMENT
    policy: PlacementPolicy = PlacementPolicy.BEST_FIT

    def __post_init__(self) -> None:
        if self.alignment < BASE_ALIGNMENT or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two >= 256, got {self.alignment}")
        object.__setattr__(self, "policy", PlacementPolicy(self.policy))


@dataclass(slots=True, eq=False)
class ArenaHandle:
    """One allocation. Owners read it; only its arena changes it."""

    offset: int
    nbytes: int  # what was asked
    range_nbytes: int  # what was carved: nbytes rounded up to the base alignment
    alignment: int  # the effective alignment; offset is a multiple of it
    is_live: bool = field(default=True, kw_only=True)

    @property
    def end(self) -> int:
        return self.offset + self.range_nbytes


class Arena:
    """Exact, aligned byte ranges of one contiguous 1-D byte buffer."""

    def __init__(self, buffer: torch.Tensor, config: ArenaConfig | None = None) -> None:
        if buffer.dim() != 1 or buffer.element_size() != 1 or not buffer.is_contiguous():
            raise ValueError("the arena buffer must be a contiguous 1-D uint8 tensor")
        self.buffer = buffer
        self.config = config or ArenaConfig()
        # Offsets are aligned relative to the buffer's start (torch's allocators start
        # allocations at least 64-byte aligned on CPU and 256-byte aligned on CUDA).
        self.num_reserved_bytes = buffer.numel() // self.config.alignment * self.config.alignment
        self._free_list = FreeList(0, self.num_reserved_bytes)
        self._live: dict[int, ArenaHandle] = {}  # offset -> handle
        self._num_allocated_bytes = 0
        self._num_waste_bytes = 0
        self._num_allocations = 0
        self._num_frees = 0

    @classmethod
    def reserve(cls, nbytes: int, device: str | torch.device = "cpu",
                config: ArenaConfig | None = None) -> Arena:
        """An arena over a fresh `nbytes` buffer on `device` (its bytes are not cleared)."""
        import torch

        if nbytes <= 0:
            raise ValueError(f"an arena needs a positive size, got {nbytes}")
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=device), config)

    # ------------------------------------------------------------ allocate/free
    def allocate(self, nbytes: int, *, alignment: int | None = None) -> ArenaHandle:
        """Take `nbytes` (rounded up to the base alignment) at an offset that is a multiple of
        `alignment` and of the base alignment; `ArenaOutOfMemoryError` if no range holds it."""
        alignment = self._effective_alignment(nbytes, alignment)
        range_nbytes = align_up(nbytes, self.config.alignment)
        offset = self._carve(nbytes, range_nbytes, alignment)
        return self._register(ArenaHandle(offset, nbytes, range_nbytes, alignment))

    def free(self, handle: ArenaHandle) -> None:
        """Give an allocation back; its range merges with its free neighbours."""
        if self._live.get(handle.offset) is not handle:
            raise ValueError("not a live allocation of this arena (freed twice, or foreign)")
        del self._live[handle.offset]
        handle.is_live = False
        self._num_allocated_bytes -= handle.nbytes
        self._num_waste_bytes -= handle.range_nbytes - handle.nbytes
        self._num_frees += 1
        self._release(handle)

    def _effective_alignment(self, nbytes: int, alignment: int | None) -> int:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        if alignment is not None and alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        return math.lcm(alignment or 1, self.config.alignment)

    def _carve(self, nbytes: int, range_nbytes: int, alignment: int) -> int:
        """Take a free range for the request (recovering space if a subclass can)."""
        offset = self._find(range_nbytes, alignment)
        if offset is None:
            offset = self._recover(range_nbytes, alignment)
        if offset is None:
            free_list = self._free_list
            raise ArenaOutOfMemoryError(nbytes, range_nbytes, alignment, free_list.total_nbytes,
                                        free_list.largest_nbytes())
        self._free_list.take(offset, range_nbytes)
        return offset

    def _find(self, range_nbytes: int, alignment: int) -> int | None:
        return self._free_list.find(range_nbytes, alignment, self.config.policy)

    def _recover(self, range_nbytes: int, alignment: int) -> int | None:
        """Make room when nothing fits and search again; the base arena cannot (None)."""
        return None

    def _register(self, handle: ArenaHandle) -> ArenaHandle:
        self._live[handle.offset] = handle
        self._num_allocated_bytes += handle.nbytes
        self._num_waste_bytes += handle.range_nbytes - handle.nbytes
        self._num_allocations += 1
        return handle

    def _release(self, handle: ArenaHandle) -> None:
        """Where a freed range goes: the free list (a subclass may park it elsewhere)."""
        self._free_list.release(handle.offset, handle.range_nbytes)

    # ---------------------------------------------------------------- reporting
    def live_handles(self) -> list[ArenaHandle]:
        """Live allocations in offset order."""
        return [self._live[offset] for offset in sorted(self._live)]

    def free_ranges(self) -> list[FreeRange]:
        """The free list, in offset order."""
        return self._free_list.ranges()

    def _unused_ranges(self) -> list[FreeRange]:
        """Every range no live allocation holds (what `check_invariants` tiles with)."""
        return self.free_ranges()

    def stats(self) -> ArenaStats:
        free_list = self._free_list
        num_free, largest = free_list.total_nbytes, free_list.largest_nbytes()
        return ArenaStats(
            num_reserved_bytes=self.num_reserved_bytes,
            num_allocated_bytes=self._num_allocated_bytes,
            num_internal_waste_bytes=self._num_waste_bytes,
            num_free_bytes=num_free,
            largest_free_range_bytes=largest,
            external_fragmentation=external_fragmentation(num_free, largest),
            num_free_ranges=len(free_list),
            num_live_allocations=len(self._live),
            num_allocations=self._num_allocations,
            num_frees=self._num_frees,
        )

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (O(n log n); for tests)."""
        self._free_list.check_invariants()
        pieces = [(handle.offset, handle.range_nbytes) for handle in self._live.values()]
        pieces += [(r.offset, r.nbytes) for r in self._unused_ranges()]
        cursor = 0
        for offset, nbytes in sorted(pieces):
            assert offset == cursor, f"gap or overlap at byte {cursor} (next piece at {offset})"
            cursor += nbytes
        assert cursor == self.num_reserved_bytes, "ranges do not cover the arena"
        for offset, handle in self._live.items():
            assert handle.is_live and handle.offset == offset and offset % handle.alignment == 0
        stats = self.stats()
        assert (stats.num_allocated_bytes + stats.num_internal_waste_bytes + stats.num_free_bytes
                == stats.num_reserved_bytes)

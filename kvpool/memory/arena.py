"""The arena: byte ranges of one preallocated buffer, handed out as typed, shaped tensor views.

The buffer is reserved once (any device); after that, allocating and freeing is bookkeeping in
Python and never calls the device allocator. `FreeList` (arena_free_list.py) knows which bytes
are free; this module adds size classes and their caches, handles, compaction and statistics.

Allocation (`allocate`):
 1. Round the request. Size-classed requests round up to the smallest class that holds them
    (default 256 KiB, 1 MiB, 4 MiB, 16 MiB), larger ones to a multiple of the large granule
    (2 MiB); exact requests (`size_class=False`) round only to the base alignment.
 2. A size-classed request first reuses the most recently freed range of its class (a cache
    hit): no search, no split, and the range is likely still warm.
 3. Otherwise it is carved from the free list under the placement policy (first/best/worst fit).
    Splitting rule: the allocation takes the chosen range at its first suitably aligned offset;
    the padding before it and the remainder after it stay free. Offsets and sizes are multiples
    of the base alignment (>= 256 B), so no leftover sliver is smaller than 256 bytes.
 4. If nothing fits: flush every class cache into the free list (where ranges coalesce) and
    retry; then, when the free total would suffice, compact and retry; then raise
    `ArenaOutOfMemoryError`.

Freeing returns a size-classed range to its class cache and an exact range to the free list,
where it merges with its free neighbours at once.

Compaction slides relocatable allocations down, in offset order, to the lowest aligned offset
above the previous allocation; pinned (non-relocatable) allocations stay put and holes in front
of them stay unless a relocatable allocation slides in. Data is copied, then each moved owner
is told `on_move(handle, old_offset, new_offset)`: tensor views taken before a move still point
at the old bytes, so owners re-take their views there.

Invariants (checked by `check_invariants`): live, cached and free ranges are disjoint and tile
`[0, num_reserved_bytes)`; every live offset is a multiple of its alignment; bytes are conserved
(see arena_stats.py); free-list ranges never touch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvpool.memory.arena_free_list import FreeList, FreeRange, align_up
from kvpool.memory.arena_policy import ArenaConfig, MiB
from kvpool.memory.arena_stats import ArenaOutOfMemoryError, ArenaStats, external_fragmentation

if TYPE_CHECKING:
    import torch

MoveCallback = Callable[["ArenaHandle", int, int], None]

# Overlapping moves are copied in pieces of at most the move distance; past this many pieces
# they are staged through a temporary copy of at most _STAGING_NBYTES instead.
_MAX_DIRECT_PIECES = 16
_STAGING_NBYTES = 8 * MiB


@dataclass(frozen=True, slots=True)
class CompactionReport:
    """What one `compact()` did: allocations moved and the bytes copied for them."""

    num_moved: int
    num_bytes_moved: int


@dataclass(slots=True, eq=False)
class ArenaHandle:
    """One allocation. Owners read it; only the arena changes it (`offset` moves on compaction)."""

    arena: Arena = field(repr=False)
    offset: int
    nbytes: int  # what was asked; the view covers exactly these bytes
    range_nbytes: int  # what was carved: nbytes plus rounding waste
    alignment: int
    size_class: int | None  # class cache the range returns to, None for exact requests
    dtype: torch.dtype | None
    shape: tuple[int, ...] | None
    relocatable: bool
    on_move: MoveCallback | None = field(repr=False)
    is_live: bool = True

    def view(self, dtype: torch.dtype, shape: Sequence[int] | None = None) -> torch.Tensor:
        """`buffer[offset:offset + nbytes].view(dtype).view(shape)`."""
        if not self.is_live:
            raise ValueError("this arena allocation was freed; its bytes may belong to another")
        if self.nbytes % dtype.itemsize:
            raise ValueError(f"{self.nbytes} bytes do not hold a whole number of {dtype}")
        raw = self.arena.buffer[self.offset : self.offset + self.nbytes].view(dtype)
        if shape is None:
            return raw
        try:
            return raw.view(tuple(shape))
        except RuntimeError as error:
            raise ValueError(f"cannot view {self.nbytes} bytes as {dtype}{list(shape)}") from error

    @property
    def tensor(self) -> torch.Tensor:
        """The view with the dtype and shape given at allocation (flat bytes by default)."""
        return self.view(self.dtype or self.arena.buffer.dtype, self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.range_nbytes


class Arena:
    """Byte ranges of one 1-D byte buffer, with size-class caches and compaction."""

    def __init__(self, buffer: torch.Tensor, config: ArenaConfig | None = None) -> None:
        if buffer.dim() != 1 or buffer.element_size() != 1 or not buffer.is_contiguous():
            raise ValueError("the arena buffer must be a contiguous 1-D uint8 tensor")
        self.buffer = buffer
        self.config = config or ArenaConfig()
        # Offsets are aligned relative to the buffer's start (torch's allocators start
        # allocations at least 64-byte aligned on CPU and 256-byte aligned on CUDA).
        self.num_reserved_bytes = buffer.numel() // self.config.alignment * self.config.alignment
        self._free_list = FreeList(0, self.num_reserved_bytes)
        self._cached_offsets: dict[int, list[int]] = {}  # class size -> offsets, newest last
        self._num_cached_bytes = 0
        self._live: dict[int, ArenaHandle] = {}  # offset -> handle
        self._num_allocated_bytes = 0
        self._num_waste_bytes = 0
        self._num_allocations = 0
        self._num_frees = 0
        self._num_compactions = 0
        self._num_bytes_moved = 0
        self._cache_hits: dict[int, int] = {}

    @classmethod
    def reserve(cls, nbytes: int, device: str | torch.device = "cpu",
                config: ArenaConfig | None = None) -> Arena:
        """An arena over a fresh `nbytes` buffer on `device`."""
        import torch

        if nbytes <= 0:
            raise ValueError(f"an arena needs a positive size, got {nbytes}")
        return cls(torch.empty(nbytes, dtype=torch.uint8, device=device), config)

    # ------------------------------------------------------------ allocate/free
    def allocate(self, nbytes: int, *, dtype: torch.dtype | None = None,
                 shape: Sequence[int] | None = None, alignment: int | None = None,
                 size_class: bool = True, relocatable: bool = False,
                 on_move: MoveCallback | None = None) -> ArenaHandle:
        """Take `nbytes`, aligned to `alignment` (rounded to a common multiple with the base).

        `size_class=False` asks for an exact range (e.g. a KV segment of N blocks with
        `alignment=block_nbytes`, so its offset is a whole number of blocks). A relocatable
        allocation may be moved by compaction; `on_move(handle, old, new)` is called after.
        """
        shape = self._check_request(nbytes, dtype, shape)
        if alignment is not None and alignment < 1:
            raise ValueError(f"alignment must be >= 1, got {alignment}")
        alignment = math.lcm(alignment or 1, self.config.alignment)
        if size_class:
            range_nbytes = self.config.class_nbytes(nbytes)
            offset = self._take_cached(range_nbytes, alignment)
        else:
            range_nbytes = align_up(nbytes, self.config.alignment)
            offset = None
        if offset is None:
            offset = self._carve(nbytes, range_nbytes, alignment)
        handle = ArenaHandle(self, offset, nbytes, range_nbytes, alignment,
                             range_nbytes if size_class else None, dtype, shape, relocatable,
                             on_move)
        self._live[offset] = handle
        self._num_allocated_bytes += nbytes
        self._num_waste_bytes += range_nbytes - nbytes
        self._num_allocations += 1
        return handle

    def free(self, handle: ArenaHandle) -> None:
        """Give an allocation back: to its class cache, or to the free list (coalescing)."""
        if self._live.get(handle.offset) is not handle:
            raise ValueError("not a live allocation of this arena (freed twice, or foreign)")
        del self._live[handle.offset]
        handle.is_live = False
        self._num_allocated_bytes -= handle.nbytes
        self._num_waste_bytes -= handle.range_nbytes - handle.nbytes
        self._num_frees += 1
        if handle.size_class is None:
            self._free_list.release(handle.offset, handle.range_nbytes)
        else:
            self._cached_offsets.setdefault(handle.size_class, []).append(handle.offset)
            self._num_cached_bytes += handle.range_nbytes

    def release_cached(self) -> int:
        """Return every class-cached range to the free list; returns the bytes released."""
        released = self._num_cached_bytes
        for size, offsets in self._cached_offsets.items():
            for offset in offsets:
                self._free_list.release(offset, size)
        self._cached_offsets.clear()
        self._num_cached_bytes = 0
        return released

    def _check_request(self, nbytes: int, dtype: torch.dtype | None,
                       shape: Sequence[int] | None) -> tuple[int, ...] | None:
        if nbytes <= 0:
            raise ValueError(f"allocation size must be positive, got {nbytes}")
        itemsize = dtype.itemsize if dtype is not None else 1
        if nbytes % itemsize:
            raise ValueError(f"{nbytes} bytes do not hold a whole number of {dtype}")
        if shape is not None and math.prod(shape) * itemsize != nbytes:
            raise ValueError(f"shape {list(shape)} of {dtype} does not take {nbytes} bytes")
        return tuple(shape) if shape is not None else None

    def _take_cached(self, size: int, alignment: int) -> int | None:
        offsets = self._cached_offsets.get(size, [])
        for index in reversed(range(len(offsets))):
            if offsets[index] % alignment == 0:
                self._num_cached_bytes -= size
                self._cache_hits[size] = self._cache_hits.get(size, 0) + 1
                return offsets.pop(index)
        return None

    def _carve(self, nbytes: int, range_nbytes: int, alignment: int) -> int:
        offset = self._find(range_nbytes, alignment)
        if offset is None and self._num_cached_bytes:
            self.release_cached()
            offset = self._find(range_nbytes, alignment)
        if offset is None and self._can_compaction_help(range_nbytes):
            self.compact()
            offset = self._find(range_nbytes, alignment)
        if offset is None:
            free_list = self._free_list
            raise ArenaOutOfMemoryError(nbytes, range_nbytes, alignment, free_list.total_nbytes,
                                        free_list.largest_nbytes())
        self._free_list.take(offset, range_nbytes)
        return offset

    def _find(self, range_nbytes: int, alignment: int) -> int | None:
        return self._free_list.find(range_nbytes, alignment, self.config.policy)

    def _can_compaction_help(self, range_nbytes: int) -> bool:
        return (
            self.config.compact_on_failure
            and range_nbytes <= self._free_list.total_nbytes
            and any(handle.relocatable for handle in self._live.values())
        )

    # --------------------------------------------------------------- compaction
    def compact(self) -> CompactionReport:
        """Close holes by sliding relocatable allocations down; tells each moved owner."""
        self.release_cached()
        moves: list[tuple[ArenaHandle, int, int]] = []
        cursor = 0
        for handle in self.live_handles():
            if handle.relocatable:
                target = align_up(cursor, handle.alignment)  # <= handle.offset: all below is free
                if target < handle.offset:
                    moves.append((handle, handle.offset, target))
                    _move_down(self.buffer, handle.offset, target, handle.nbytes)
                    handle.offset = target
            cursor = handle.end
        self._live = {handle.offset: handle for handle in self._live.values()}
        self._free_list = FreeList(0, self.num_reserved_bytes)
        for handle in self.live_handles():
            self._free_list.take(handle.offset, handle.range_nbytes)
        num_bytes_moved = sum(handle.nbytes for handle, _, _ in moves)
        self._num_compactions += 1
        self._num_bytes_moved += num_bytes_moved
        # Owners hear about moves only once the arena is consistent again.
        for handle, old_offset, new_offset in moves:
            if handle.on_move is not None:
                handle.on_move(handle, old_offset, new_offset)
        return CompactionReport(len(moves), num_bytes_moved)

    # ---------------------------------------------------------------- reporting
    def live_handles(self) -> list[ArenaHandle]:
        """Live allocations in offset order."""
        return [self._live[offset] for offset in sorted(self._live)]

    def free_ranges(self) -> list[FreeRange]:
        """The free list (class-cached ranges not included)."""
        return self._free_list.ranges()

    def cached_ranges(self) -> list[FreeRange]:
        """Ranges parked in class caches, in offset order."""
        return sorted(FreeRange(offset, size) for size, offsets in self._cached_offsets.items()
                      for offset in offsets)

    def stats(self) -> ArenaStats:
        num_free = self._free_list.total_nbytes + self._num_cached_bytes
        cached_sizes = [size for size, offsets in self._cached_offsets.items() if offsets]
        largest = max(self._free_list.largest_nbytes(), *cached_sizes, 0)
        return ArenaStats(
            num_reserved_bytes=self.num_reserved_bytes,
            num_allocated_bytes=self._num_allocated_bytes,
            num_internal_waste_bytes=self._num_waste_bytes,
            num_free_bytes=num_free,
            num_cached_bytes=self._num_cached_bytes,
            largest_free_range_bytes=largest,
            external_fragmentation=external_fragmentation(num_free, largest),
            num_free_ranges=len(self._free_list),
            num_live_allocations=len(self._live),
            num_allocations=self._num_allocations,
            num_frees=self._num_frees,
            num_compactions=self._num_compactions,
            num_bytes_moved=self._num_bytes_moved,
            cache_hits=dict(self._cache_hits),
        )

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (O(n log n); for tests)."""
        self._free_list.check_invariants()
        pieces = [(handle.offset, handle.range_nbytes) for handle in self._live.values()]
        pieces += [(r.offset, r.nbytes) for r in self.free_ranges() + self.cached_ranges()]
        cursor = 0
        for offset, nbytes in sorted(pieces):
            assert offset == cursor, f"gap or overlap at byte {cursor} (next piece at {offset})"
            cursor += nbytes
        assert cursor == self.num_reserved_bytes, "ranges do not cover the arena"
        for offset, handle in self._live.items():
            assert handle.offset == offset and offset % handle.alignment == 0
        stats = self.stats()
        assert (stats.num_allocated_bytes + stats.num_internal_waste_bytes + stats.num_free_bytes
                == stats.num_reserved_bytes)


def _move_down(buffer: torch.Tensor, src: int, dst: int, nbytes: int) -> None:
    """Copy `buffer[src:src + nbytes]` to `dst < src`, even when the two overlap.

    Front to back, a piece of at most `src - dst` bytes never overlaps its own source and only
    overwrites source bytes already copied (torch refuses overlapping copies). When that would
    take many small pieces, each piece is staged through a temporary copy instead.
    """
    distance = src - dst
    assert distance > 0
    is_staged = nbytes > distance * _MAX_DIRECT_PIECES
    piece = min(nbytes, _STAGING_NBYTES) if is_staged else distance
    for start in range(0, nbytes, piece):
        count = min(piece, nbytes - start)
        source = buffer[src + start : src + start + count]
        buffer[dst + start : dst + start + count].copy_(source.clone() if is_staged else source)

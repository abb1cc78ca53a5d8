"""The simulator's arena: the engine's `Arena` plus size classes, class caches and compaction.

The engine's arena (kvpool/memory/arena.py) hands out exact ranges and never moves them. The
seed design also asked for size classes, class caches and compaction; they live here, on top of
that arena (its free list, placement, handles and statistics are reused, not copied), and the
contiguous strategies `contiguous-classes` and `contiguous-exact-compact` measure what they buy
(kvpool/sim/contiguous.py).

Size classes (`SizeClasses`, the seed design): 256 KiB, 1 MiB, 4 MiB, 16 MiB, and past the
largest class a multiple of a 2 MiB granule. A class is both a rounding rule (a request takes
the smallest class that holds it) and a cache key.

Allocation (`allocate`):
 1. A size-classed request (the default) rounds up to its class; `size_class=False` rounds
    only to the base alignment, as the engine's arena does.
 2. A size-classed request first reuses the most recently freed range of its class that is
    suitably aligned (a cache hit, LIFO: likely still warm): no search, no split.
 3. Otherwise the base arena carves a range under the placement policy. If nothing fits,
    `_recover` flushes every class cache into the free list (where ranges coalesce) and
    searches again; then, when the free total would hold the request and relocatable
    allocations exist, it compacts and searches again; then the base arena raises.

Freeing parks a size-classed range in its class's cache, out of the free list (it does not
coalesce until flushed); an exact range goes back to the free list at once.

Compaction (`compact`) slides relocatable allocations down, in offset order, to the lowest
aligned offset after the previous allocation; pinned allocations stay, and so do the holes in
front of them unless a relocatable allocation slides in. Handles are updated in place, so an
owner holding its handle reads the new offset. Data is copied (overlapping moves in pieces no
longer than the move distance, torch refusing overlapping copies; staged through a bounded
temporary when that would take many pieces); a `meta` buffer holds no data, so only the
bookkeeping runs.

Invariants (on top of the base arena's, checked by `check_invariants`): live, cached and free
ranges tile the arena; a cached range's size is its class; bytes are conserved with cached
ranges counted as free.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.memory.arena import Arena, ArenaConfig, ArenaHandle
from kvpool.memory.arena_free_list import FreeList, FreeRange, align_up
from kvpool.memory.arena_stats import ArenaStats, external_fragmentation

if TYPE_CHECKING:
    import torch

KiB = 1 << 10
MiB = 1 << 20
DEFAULT_CLASSES = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
DEFAULT_LARGE_GRANULE = 2 * MiB

# Overlapping moves are copied in pieces of at most the move distance; past this many pieces
# they are staged through a temporary copy of at most _STAGING_NBYTES instead.
_MAX_DIRECT_PIECES = 16
_STAGING_NBYTES = 8 * MiB


@dataclass(frozen=True, slots=True)
class SizeClasses:
    """Class sizes and the granule past the largest (tests use tiny ones)."""

    sizes: tuple[int, ...] = DEFAULT_CLASSES
    large_granule: int = DEFAULT_LARGE_GRANULE

    def __post_init__(self) -> None:
        if list(self.sizes) != sorted(set(self.sizes)):
            raise ValueError(f"size classes must be strictly increasing, got {self.sizes}")
        if min((*self.sizes, self.large_granule)) <= 0:
            raise ValueError("size classes and the large granule must be positive")

    def class_nbytes(self, nbytes: int) -> int:
        """The size class `nbytes` rounds to (the smallest class or granule multiple >= it)."""
        for size in self.sizes:
            if nbytes <= size:
                return size
        return align_up(nbytes, self.large_granule)


@dataclass(frozen=True, slots=True)
class CompactionReport:
    """What one `compact()` did: allocations moved and the bytes copied for them."""

    num_moved: int
    num_bytes_moved: int


@dataclass(frozen=True, slots=True)
class SizeClassStats:
    """What the size-class arena adds to `ArenaStats`; counters since the arena was made."""

    num_cached_bytes: int  # the part of ArenaStats.num_free_bytes parked in class caches
    cache_hits: dict[int, int]  # size class (bytes) -> allocations served from its cache
    num_compactions: int
    num_bytes_moved: int


@dataclass(slots=True, eq=False)
class ClassedHandle(ArenaHandle):
    """An allocation that may belong to a size class and may be moved by compaction."""

    size_class: int | None = None  # the class cache the range returns to; None: exact
    relocatable: bool = False


class SizeClassArena(Arena):
    """`Arena` with size classes, class caches and compaction (see the module docstring)."""

    def __init__(self, buffer: torch.Tensor, config: ArenaConfig | None = None,
                 classes: SizeClasses | None = None) -> None:
        super().__init__(buffer, config)
        self.classes = classes or SizeClasses()
        for size in (*self.classes.sizes, self.classes.large_granule):
            if size % self.config.alignment:
                raise ValueError(f"size {size} is not a multiple of {self.config.alignment}")
        self._cached_offsets: dict[int, list[int]] = {}  # class size -> offsets, newest last
        self._num_cached_bytes = 0
        self._cache_hits: dict[int, int] = {}
        self._num_compactions = 0
        self._num_bytes_moved = 0

    # ------------------------------------------------------------ allocate/free
    def allocate(self, nbytes: int, *, alignment: int | None = None, size_class: bool = True,
                 relocatable: bool = False) -> ClassedHandle:
        """Take `nbytes`: a size-class range (reused from its cache when one waits there), or
        with `size_class=False` an exact one. A relocatable allocation may be moved by
        compaction."""
        alignment = self._effective_alignment(nbytes, alignment)
        if size_class:
            range_nbytes = self.classes.class_nbytes(nbytes)
            offset = self._take_cached(range_nbytes, alignment)
        else:
            range_nbytes = align_up(nbytes, self.config.alignment)
            offset = None
        if offset is None:
            offset = self._carve(nbytes, range_nbytes, alignment)
        handle = ClassedHandle(offset, nbytes, range_nbytes, alignment,
                               size_class=range_nbytes if size_class else None,
                               relocatable=relocatable)
        self._register(handle)
        return handle

    def _release(self, handle: ArenaHandle) -> None:
        size = handle.size_class if isinstance(handle, ClassedHandle) else None
        if size is None:
            super()._release(handle)
            return
        self._cached_offsets.setdefault(size, []).append(handle.offset)
        self._num_cached_bytes += size

    def release_cached(self) -> int:
        """Return every class-cached range to the free list; returns the bytes released."""
        released = self._num_cached_bytes
        for size, offsets in self._cached_offsets.items():
            for offset in offsets:
                self._free_list.release(offset, size)
        self._cached_offsets.clear()
        self._num_cached_bytes = 0
        return released

    def _take_cached(self, size: int, alignment: int) -> int | None:
        offsets = self._cached_offsets.get(size, [])
        for index in reversed(range(len(offsets))):
            if offsets[index] % alignment == 0:
                self._num_cached_bytes -= size
                self._cache_hits[size] = self._cache_hits.get(size, 0) + 1
                return offsets.pop(index)
        return None

    def _recover(self, range_nbytes: int, alignment: int) -> int | None:
        """Flush the class caches and search again; then compact, if it can help, and again."""
        if self._num_cached_bytes:
            self.release_cached()
            offset = self._find(range_nbytes, alignment)
            if offset is not None:
                return offset
        if range_nbytes <= self._free_list.total_nbytes and any(
            map(_is_relocatable, self._live.values())
        ):
            self.compact()
            return self._find(range_nbytes, alignment)
        return None

    # --------------------------------------------------------------- compaction
    def compact(self) -> CompactionReport:
        """Close holes by sliding relocatable allocations down (after flushing the caches)."""
        self.release_cached()
        num_moved = num_bytes_moved = 0
        cursor = 0
        for handle in self.live_handles():
            if _is_relocatable(handle):
                target = align_up(cursor, handle.alignment)  # <= handle.offset: all below is free
                if target < handle.offset:
                    _move_down(self.buffer, handle.offset, target, handle.nbytes)
                    handle.offset = target
                    num_moved += 1
                    num_bytes_moved += handle.nbytes
            cursor = handle.end
        self._live = {handle.offset: handle for handle in self._live.values()}
        self._free_list = FreeList(0, self.num_reserved_bytes)
        for handle in self.live_handles():
            self._free_list.take(handle.offset, handle.range_nbytes)
        self._num_compactions += 1
        self._num_bytes_moved += num_bytes_moved
        return CompactionReport(num_moved, num_bytes_moved)

    # ---------------------------------------------------------------- reporting
    def cached_ranges(self) -> list[FreeRange]:
        """Ranges parked in class caches, in offset order."""
        return sorted(FreeRange(offset, size) for size, offsets in self._cached_offsets.items()
                      for offset in offsets)

    def _unused_ranges(self) -> list[FreeRange]:
        return self.free_ranges() + self.cached_ranges()

    def stats(self) -> ArenaStats:
        """The base statistics with cached ranges counted as free (they serve their class)."""
        base = super().stats()
        cached_sizes = [size for size, offsets in self._cached_offsets.items() if offsets]
        num_free = base.num_free_bytes + self._num_cached_bytes
        largest = max(base.largest_free_range_bytes, *cached_sizes, 0)
        return dataclasses.replace(
            base, num_free_bytes=num_free, largest_free_range_bytes=largest,
            external_fragmentation=external_fragmentation(num_free, largest),
        )

    def class_stats(self) -> SizeClassStats:
        return SizeClassStats(self._num_cached_bytes, dict(self._cache_hits),
                              self._num_compactions, self._num_bytes_moved)


def _is_relocatable(handle: ArenaHandle) -> bool:
    return isinstance(handle, ClassedHandle) and handle.relocatable


def _move_down(buffer: torch.Tensor, src: int, dst: int, nbytes: int) -> None:
    """Copy `buffer[src:src + nbytes]` to `dst < src`, even when the two overlap.

    Front to back, a piece of at most `src - dst` bytes never overlaps its own source and only
    overwrites source bytes already copied (torch refuses overlapping copies). When that would
    take many small pieces, each piece is staged through a temporary copy instead.
    """
    distance = src - dst
    assert distance > 0
    if buffer.is_meta:
        return  # no data: the simulator's budget costs nothing to "move"
    is_staged = nbytes > distance * _MAX_DIRECT_PIECES
    piece = min(nbytes, _STAGING_NBYTES) if is_staged else distance
    for start in range(0, nbytes, piece):
        count = min(piece, nbytes - start)
        source = buffer[src + start : src + start + count]
        buffer[dst + start : dst + start + count].copy_(source.clone() if is_staged else source)


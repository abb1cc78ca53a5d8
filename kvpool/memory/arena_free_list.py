"""The arena's free list: the free byte ranges of one buffer, placement policies and coalescing.

Pure Python and unit-agnostic (it never touches the buffer), so the allocation simulator can use
it as well as `Arena`.

Invariants (checked by `check_invariants`):
- Ranges are non-empty, disjoint and kept sorted by offset.
- No two ranges touch: a range that is released merges with its free neighbours at once, so
  every free range is as large as it can be.
- `total_nbytes` equals the summed size of the ranges.

Placement (`find`) looks for a range that can hold `nbytes` at an offset that is a multiple of
`alignment`; the allocation then sits at the first such offset of the range (see `take`):

    first fit   the lowest-offset range that fits (fast, keeps the high end free)
    best fit    the smallest range that fits (keeps large ranges whole for large requests)
    worst fit   the largest range (its leftover is the most likely to stay useful)

Ties go to the lowest offset, so every policy is deterministic.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from enum import Enum

from kvpool.memory.kv_layout import cdiv


class PlacementPolicy(str, Enum):
    """Which free range a new allocation is carved from."""

    FIRST_FIT = "first"
    BEST_FIT = "best"
    WORST_FIT = "worst"


@dataclass(frozen=True, slots=True, order=True)
class FreeRange:
    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


def align_up(value: int, alignment: int) -> int:
    return cdiv(value, alignment) * alignment


class FreeList:
    """Disjoint, coalesced free ranges of `[offset, offset + nbytes)`, initially all free."""

    def __init__(self, offset: int, nbytes: int) -> None:
        if offset < 0 or nbytes < 0:
            raise ValueError(f"offset and nbytes must be >= 0, got {offset} and {nbytes}")
        self._offsets: list[int] = []  # sorted range starts
        self._nbytes_by_offset: dict[int, int] = {}
        self.total_nbytes = 0
        if nbytes:
            self._insert(offset, nbytes)

    # ----------------------------------------------------------------- queries
    def __len__(self) -> int:
        return len(self._offsets)

    def ranges(self) -> list[FreeRange]:
        return [FreeRange(offset, self._nbytes_by_offset[offset]) for offset in self._offsets]

    def largest_nbytes(self) -> int:
        return max(self._nbytes_by_offset.values(), default=0)

    def find(self, nbytes: int, alignment: int, policy: PlacementPolicy) -> int | None:
        """The offset where `nbytes` would be placed under `policy`, or None if nothing fits."""
        best_offset: int | None = None
        best_range_nbytes = 0
        for start in self._offsets:
            range_nbytes = self._nbytes_by_offset[start]
            placed = align_up(start, alignment)
            if placed + nbytes > start + range_nbytes:
                continue
            if policy is PlacementPolicy.FIRST_FIT:
                return placed
            is_better = (
                best_offset is None
                or (policy is PlacementPolicy.BEST_FIT and range_nbytes < best_range_nbytes)
                or (policy is PlacementPolicy.WORST_FIT and range_nbytes > best_range_nbytes)
            )
            if is_better:
                best_offset, best_range_nbytes = placed, range_nbytes
        return best_offset

    # ----------------------------------------------------------------- changes
    def take(self, offset: int, nbytes: int) -> None:
        """Mark `[offset, offset + nbytes)` used; it must lie inside one free range.

        Splitting rule: whatever of the range lies before `offset` (alignment padding) and after
        the allocation stays free, as (at most) two ranges.
        """
        index = bisect.bisect_right(self._offsets, offset) - 1
        assert index >= 0, f"[{offset}, {offset + nbytes}) is not free"
        start = self._offsets[index]
        end = start + self._nbytes_by_offset[start]
        assert offset + nbytes <= end, f"[{offset}, {offset + nbytes}) is not free"
        self._remove(start)
        if offset > start:
            self._insert(start, offset - start)
        if offset + nbytes < end:
            self._insert(offset + nbytes, end - offset - nbytes)

    def release(self, offset: int, nbytes: int) -> None:
        """Mark `[offset, offset + nbytes)` free, merging it with the free ranges it touches."""
        assert nbytes > 0
        index = bisect.bisect_left(self._offsets, offset)
        end = offset + nbytes
        if index < len(self._offsets):
            next_start = self._offsets[index]
            assert end <= next_start, f"[{offset}, {end}) overlaps a free range"
            if end == next_start:
                end += self._nbytes_by_offset[next_start]
                self._remove(next_start)
        if index > 0:
            prev_start = self._offsets[index - 1]
            prev_end = prev_start + self._nbytes_by_offset[prev_start]
            assert prev_end <= offset, f"[{offset}, {end}) overlaps a free range"
            if prev_end == offset:
                offset = prev_start
                self._remove(prev_start)
        self._insert(offset, end - offset)

    def check_invariants(self) -> None:
        assert self._offsets == sorted(self._nbytes_by_offset)
        previous_end: int | None = None
        for free_range in self.ranges():
            assert free_range.nbytes > 0
            assert previous_end is None or free_range.offset > previous_end, "ranges touch"
            previous_end = free_range.end
        assert self.total_nbytes == sum(self._nbytes_by_offset.values())

    def _insert(self, offset: int, nbytes: int) -> None:
        bisect.insort(self._offsets, offset)
        self._nbytes_by_offset[offset] = nbytes
        self.total_nbytes += nbytes

    def _remove(self, offset: int) -> None:
        del self._offsets[bisect.bisect_left(self._offsets, offset)]
        self.total_nbytes -= self._nbytes_by_offset.pop(offset)

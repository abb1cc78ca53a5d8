"""What the arena reports: its statistics snapshot and its out-of-memory error.

Byte accounting (every byte of the reserved range is in exactly one bucket):

    num_reserved_bytes = num_allocated_bytes      bytes the live allocations asked for
                       + num_internal_waste_bytes  rounding up to the base alignment (256 B);
                                                   the simulator's size classes add theirs
                       + num_free_bytes            held by no allocation (the free list; in
                                                   the simulator's arena also class caches)

External fragmentation is `1 - largest free range / total free`: 0 when the free bytes form one
range (any request that fits in total fits in place), close to 1 when they are scattered.
"""

from __future__ import annotations

from dataclasses import dataclass

_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


def format_bytes(nbytes: int) -> str:
    """`1.50 MiB (1572864 B)`: readable, and exact for anyone checking arithmetic."""
    for scale, unit in _UNITS:
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit} ({nbytes} B)"
    return f"{nbytes} B"


def external_fragmentation(num_free_bytes: int, largest_free_bytes: int) -> float:
    """1 - largest free range / total free; 0 when nothing is free."""
    return 1.0 - largest_free_bytes / num_free_bytes if num_free_bytes else 0.0


@dataclass(frozen=True, slots=True)
class ArenaStats:
    """A snapshot of an arena; sizes in bytes, counters since the arena was made."""

    num_reserved_bytes: int
    num_allocated_bytes: int
    num_internal_waste_bytes: int
    num_free_bytes: int
    largest_free_range_bytes: int
    external_fragmentation: float
    num_free_ranges: int
    num_live_allocations: int
    num_allocations: int
    num_frees: int


class ArenaOutOfMemoryError(RuntimeError):
    """No free range of the arena can hold the request (after whatever the arena could do to
    make room: the simulator's size-class arena flushes its caches and compacts first).

    The message says what was asked, what is free in total and in the largest range, and how
    fragmented the free space is, so "out of memory with 3 GiB free" explains itself.
    """

    def __init__(self, num_requested_bytes: int, num_rounded_bytes: int, alignment: int,
                 num_free_bytes: int, largest_free_bytes: int) -> None:
        self.num_requested_bytes = num_requested_bytes
        self.num_rounded_bytes = num_rounded_bytes
        self.num_free_bytes = num_free_bytes
        self.largest_free_bytes = largest_free_bytes
        self.fragmentation = external_fragmentation(num_free_bytes, largest_free_bytes)
        super().__init__(
            f"arena out of memory: asked for {format_bytes(num_requested_bytes)}"
            f" ({format_bytes(num_rounded_bytes)} after rounding, alignment {alignment} B);"
            f" free in total {format_bytes(num_free_bytes)},"
            f" largest free range {format_bytes(largest_free_bytes)},"
            f" external fragmentation {self.fragmentation:.1%}"
        )

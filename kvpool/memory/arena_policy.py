"""The arena's configuration: size classes, rounding, alignment and placement policy.

Size classes follow the seed design: 256 KiB, 1 MiB, 4 MiB and 16 MiB, and past the largest
class a 2 MiB granule. A class is both a rounding rule (a request takes the smallest class that
holds it) and a cache key (a freed range waits in its class's cache for the next request of
that class). Tests pass tiny classes to keep arenas small.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.memory.arena_free_list import PlacementPolicy, align_up

KiB = 1 << 10
MiB = 1 << 20
DEFAULT_SIZE_CLASSES = (256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)


@dataclass(frozen=True, slots=True)
class ArenaConfig:
    """Size classes, rounding, alignment and placement of an arena (tests use tiny classes)."""

    size_classes: tuple[int, ...] = DEFAULT_SIZE_CLASSES
    large_granule: int = 2 * MiB
    alignment: int = 256
    policy: PlacementPolicy = PlacementPolicy.BEST_FIT
    compact_on_failure: bool = True

    def __post_init__(self) -> None:
        if self.alignment < 256 or self.alignment & (self.alignment - 1):
            raise ValueError(f"alignment must be a power of two >= 256, got {self.alignment}")
        if list(self.size_classes) != sorted(set(self.size_classes)):
            raise ValueError(f"size_classes must be strictly increasing, got {self.size_classes}")
        for size in (*self.size_classes, self.large_granule):
            if size <= 0 or size % self.alignment:
                raise ValueError(f"size {size} is not a positive multiple of {self.alignment}")
        object.__setattr__(self, "policy", PlacementPolicy(self.policy))

    def class_nbytes(self, nbytes: int) -> int:
        """The size class `nbytes` rounds to (the smallest class or granule multiple >= it)."""
        for size in self.size_classes:
            if nbytes <= size:
                return size
        return align_up(nbytes, self.large_granule)

"""Allocation and free rates of a block pool over a sliding window of recent steps.

`PoolRates`, a listener on the pool's fan-out, samples the pool's cumulative counters at the
end of every step (`PoolRateWindow.sample`) and forgets them when the pool is reset; a rate is the
counter's change between the oldest sample still inside the window and the newest, divided by
the time between them. Samples closer than `min_spacing_s` to the previous one replace it, so
memory stays bounded at a few hundred samples whatever the step rate.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from kvpool.memory.kv_listener import KVListener

if TYPE_CHECKING:
    from kvpool.memory.block_pool import BlockPool


class PoolRateWindow:
    """Blocks allocated and freed per second over the last `window_s` seconds."""

    def __init__(self, window_s: float = 10.0, min_spacing_s: float = 0.05) -> None:
        self.window_s = window_s
        self.min_spacing_s = min_spacing_s
        self._samples: deque[tuple[float, int, int]] = deque()  # (time, allocations, frees)

    def clear(self) -> None:
        self._samples.clear()

    def sample(self, now: float, num_allocations: int, num_frees: int) -> None:
        samples = self._samples
        if len(samples) > 1 and now - samples[-2][0] < self.min_spacing_s:
            samples[-1] = (now, num_allocations, num_frees)
        else:
            samples.append((now, num_allocations, num_frees))
        while len(samples) > 2 and now - samples[1][0] >= self.window_s:
            samples.popleft()

    def rates(self) -> tuple[float, float, float]:
        """(allocations per s, frees per s, seconds covered); zeros before two samples."""
        if len(self._samples) < 2:
            return 0.0, 0.0, 0.0
        (start, allocs0, frees0), (end, allocs1, frees1) = self._samples[0], self._samples[-1]
        span = end - start
        if span <= 0:
            return 0.0, 0.0, 0.0
        return (allocs1 - allocs0) / span, (frees1 - frees0) / span, span


class PoolRates(KVListener):
    """A pool's alloc/free rates, kept current by the step-end events it hears."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.window = PoolRateWindow()

    def step_ended(self, next_step: int) -> None:
        self.window.sample(self.pool.now, *self.pool.allocation_counters())

    def pool_cleared(self, medium: str) -> None:
        if medium == self.pool.medium:
            self.window.clear()

    def rates(self) -> tuple[float, float, float]:
        """(allocations per s, frees per s, seconds covered); zeros before two samples."""
        return self.window.rates()

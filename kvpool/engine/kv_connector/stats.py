"""`KVTransferStats`: what a connector moved and holds, for metrics and the snapshot."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from kvpool.engine.kv_connector.errors import FAILURE_REASONS, FailureReason

# Upper bounds (seconds) of the load-latency histogram's buckets: a loopback load of a few
# blocks takes milliseconds, one that hits the transfer deadline tens of seconds.
LOAD_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                        5.0, 10.0, 30.0)


@dataclass(slots=True)
class LatencyHistogram:
    """Counts of observations per bucket (not cumulative; the last is +Inf) and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LOAD_SECONDS_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LOAD_SECONDS_BUCKETS, seconds)] += 1
        self.total += seconds


@dataclass(frozen=True, slots=True)
class KVTransferStats:
    """Counters since start (blocks and bytes by direction, failed loads by reason, leases
    granted / released / expired), gauges now (live leases and the blocks they hold, loads in
    flight), and the histogram of successful loads' durations (`load_seconds_counts[i]`: loads
    within `LOAD_SECONDS_BUCKETS[i]` and above the previous bound; the last, above them all)."""

    role: str
    num_sent_blocks: int = 0  # blocks of leases their reader released after loading
    num_sent_bytes: int = 0
    num_received_blocks: int = 0
    num_received_bytes: int = 0
    failures: tuple[tuple[FailureReason, int], ...] = tuple((r, 0) for r in FAILURE_REASONS)
    num_leases: int = 0
    num_leased_blocks: int = 0
    num_leases_granted: int = 0
    num_leases_released: int = 0
    num_leases_expired: int = 0
    num_loading: int = 0
    load_seconds_counts: tuple[int, ...] = (0,) * (len(LOAD_SECONDS_BUCKETS) + 1)
    load_seconds_sum: float = 0.0

    @property
    def failures_by_reason(self) -> dict[str, int]:
        return dict(self.failures)

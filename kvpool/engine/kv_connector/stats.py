"""`KVTransferStats`: what a connector moved and holds, for metrics and the snapshot."""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.engine.kv_connector.errors import FAILURE_REASONS, FailureReason


@dataclass(frozen=True, slots=True)
class KVTransferStats:
    """Counters since start (blocks and bytes by direction, failed loads by reason, leases
    granted / released / expired), gauges now (live leases and the blocks they hold), and the
    durations of the loads that succeeded since the previous read (`load_seconds`, for a
    histogram: each is handed out once)."""

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
    load_seconds: tuple[float, ...] = ()

    @property
    def failures_by_reason(self) -> dict[str, int]:
        return dict(self.failures)

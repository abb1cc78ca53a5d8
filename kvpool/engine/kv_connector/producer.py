"""The producer's half of a handover: lease a finished prompt's blocks, gate its readers.

A prefill worker that answers a `do_remote_decode` request leases the prompt's full blocks
(`kvpool.memory.block_leases`): they stay in its pool, unchanged, until the reader says it is
done (`release_later`, from the side channel's thread) or the lease expires. Readers pull the
bytes themselves (the transfer engine reads this process's registered memory), then ask for
the blocks' checksums; `checksums` answers only while the lease is live and every (block,
generation) pair is current, so bytes read from a block that was freed and reused meanwhile
are never accepted: a lease live at the checksum means it was live through the read before.

Threads: the engine's step thread grants, releases and expires leases (`hand_over`, `tick`),
since those change the pool; readers' requests (`check`, `checksums`, `release_later`) come
on the side channel's thread. One lock orders them: a check and its checksums happen while no
lease can end, and a lease that ends is refused by every check after.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence

import torch

from kvpool.engine.kv_connector.checksums import block_checksums
from kvpool.engine.kv_connector.errors import KVTransferError
from kvpool.memory.block_leases import (
    BlockLeases,
    BlockLeaseStats,
    Lease,
    LeaseRefused,
    ReleaseOutcome,
)
from kvpool.memory.block_pool import BlockPool


class KVProducer:
    """Leases on `pool`'s blocks for remote readers of `tensors` (block-major KV)."""

    def __init__(self, pool: BlockPool, tensors: Sequence[torch.Tensor],
                 lease_seconds: float) -> None:
        self.leases = BlockLeases(pool, lease_seconds)
        self._tensors = tuple(tensors)
        self._lock = threading.Lock()
        self._releases: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.num_sent_blocks = 0  # blocks a reader read and had checksummed under its lease
        self.num_sent_bytes = 0

    # -------------------------------------------------------- step thread
    def hand_over(self, lease_id: str, block_ids: Sequence[int], now: float) -> Lease:
        """Lease `block_ids` (used or cached) to a reader under `lease_id`."""
        with self._lock:
            return self.leases.lease(lease_id, block_ids, now)

    def tick(self, now: float) -> list[str]:
        """End the leases readers released, then those past their expiry; returns the lease
        ids released (the finished sends)."""
        released = []
        with self._lock:
            while True:
                try:
                    lease_id = self._releases.get_nowait()
                except queue.Empty:
                    break
                if self.leases.release(lease_id) is ReleaseOutcome.RELEASED:
                    released.append(lease_id)
            self.leases.expire(now)
        return released

    def release_all(self) -> None:
        """End every lease (the engine is closing)."""
        with self._lock:
            for lease in self.leases.live_leases():
                self.leases.release(lease.lease_id)

    # ------------------------------------------------------- any thread
    def check(self, lease_id: str, pairs: Sequence[tuple[int, int]], now: float) -> None:
        """KVTransferError ("lease") unless the lease is live and holds every pair now."""
        with self._lock:
            self._check(lease_id, pairs, now)

    def checksums(self, lease_id: str, pairs: Sequence[tuple[int, int]],
                  now: float) -> list[int]:
        """The pairs' blocks' checksums, taken while the lease is checked live and current;
        KVTransferError ("lease") otherwise."""
        with self._lock:
            self._check(lease_id, pairs, now)
            checksums = block_checksums(self._tensors, [block_id for block_id, _ in pairs])
            self.num_sent_blocks += len(pairs)
            self.num_sent_bytes += len(pairs) * self._bytes_per_block
            return checksums

    def release_later(self, lease_id: str) -> None:
        """A reader is done with the lease: it ends at the step thread's next tick."""
        self._releases.put(lease_id)

    def live_leases(self) -> list[Lease]:
        with self._lock:
            return self.leases.live_leases()

    def stats(self) -> BlockLeaseStats:
        with self._lock:
            return self.leases.stats()

    def _check(self, lease_id: str, pairs: Sequence[tuple[int, int]], now: float) -> None:
        try:
            self.leases.check(lease_id, pairs, now)
        except LeaseRefused as refused:
            raise KVTransferError("lease", str(refused)) from refused

    @property
    def _bytes_per_block(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self._tensors)

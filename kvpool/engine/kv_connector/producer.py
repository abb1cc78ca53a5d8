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
        self._digests: dict[str, str] = {}  # live lease -> its prompt's token digest
        self.num_sent_blocks = 0  # blocks a reader read and had checksummed under its lease
        self.num_sent_bytes = 0

    # -------------------------------------------------------- step thread
    def hand_over(self, lease_id: str, block_ids: Sequence[int], prompt_digest: str,
                  now: float) -> Lease:
        """Lease `block_ids` (used or cached), the KV of the prompt whose token digest is
        `prompt_digest`, to a reader under `lease_id` (unguessable: it is the reader's
        capability)."""
        with self._lock:
            lease = self.leases.lease(lease_id, block_ids, now)
            self._digests[lease_id] = prompt_digest
            return lease

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
            ended = released + self.leases.expire(now)
            for lease_id in ended:
                self._digests.pop(lease_id, None)
        return released

    def release_all(self) -> None:
        """End every lease (the engine is closing)."""
        with self._lock:
            for lease in self.leases.live_leases():
                self.leases.release(lease.lease_id)
            self._digests.clear()

    # ------------------------------------------------------- any thread
    def check(self, lease_id: str, prompt_digest: str, pairs: Sequence[tuple[int, int]],
              now: float) -> None:
        """KVTransferError ("lease") unless the lease is live, was granted for the prompt of
        `prompt_digest` (the reader's own prompt: a lease is no way to another prompt's KV)
        and holds every pair now."""
        with self._lock:
            self._check(lease_id, prompt_digest, pairs, now)

    def checksums(self, lease_id: str, prompt_digest: str, pairs: Sequence[tuple[int, int]],
                  now: float) -> list[int]:
        """The pairs' blocks' checksums, taken while the lease is checked as `check` does;
        KVTransferError ("lease") otherwise."""
        with self._lock:
            self._check(lease_id, prompt_digest, pairs, now)
            checksums = block_checksums(self._tensors, [block_id for block_id, _ in pairs])
            self.num_sent_blocks += len(pairs)
            self.num_sent_bytes += len(pairs) * self.leases.pool.layout.bytes_per_block
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

    def _check(self, lease_id: str, prompt_digest: str, pairs: Sequence[tuple[int, int]],
               now: float) -> None:
        try:
            self.leases.check(lease_id, pairs, now)
        except LeaseRefused as refused:
            raise KVTransferError("lease", str(refused)) from refused
        if self._digests.get(lease_id) != prompt_digest:
            raise KVTransferError("lease", f"lease {lease_id!r} holds another prompt's KV")

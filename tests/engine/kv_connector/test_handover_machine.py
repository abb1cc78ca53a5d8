"""The handover's safety as a state machine: a producer's pool whose blocks are leased, freed,
reused and overwritten in any order, and readers whose transfers (a fake transport: a copy of
the producer's bytes at the moment it runs) land at any moment, before or after their lease
ended, before or after the block was given to someone else. A reader accepts what it read
only as the consumer does: the checksums, asked under the lease after the read, must pass
the producer's gate and match. The property: every accepted read holds exactly the bytes the
lease was granted on, so a block freed and reused is never served, however late the read."""

from __future__ import annotations

import itertools
import zlib

import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    rule,
)

from kvpool.engine.kv_connector.checksums import block_checksums
from kvpool.engine.kv_connector.errors import KVTransferError
from kvpool.engine.kv_connector.producer import KVProducer
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.kv_layout import KVLayout

NUM_BLOCKS = 6
LEASE_SECONDS = 2.0


class Handover(RuleBasedStateMachine):
    leases = Bundle("leases")
    reads = Bundle("reads")

    def __init__(self) -> None:
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, KVLayout(block_size=4))
        self.kv = torch.zeros(NUM_BLOCKS + 1, 8)
        self.producer = KVProducer(self.pool, [self.kv], LEASE_SECONDS)
        self.now = 0.0
        self.stamps = itertools.count(1)
        self.granted: dict[str, dict[int, float]] = {}  # lease -> block -> its bytes' stamp
        self.held: list[int] = []  # blocks a running request holds
        self.num_accepted = 0

    def _write(self, block_ids: list[int]) -> dict[int, float]:
        stamps = {block_id: float(next(self.stamps)) for block_id in block_ids}
        for block_id, stamp in stamps.items():
            self.kv[block_id] = stamp
        return stamps

    @rule(target=leases, num_blocks=st.integers(1, 3))
    def finish_a_prompt(self, num_blocks: int):
        """A prefill computes blocks, its request ends, and they are leased to a reader."""
        if self.pool.num_free_blocks < num_blocks:
            return multiple()  # nothing to grant
        block_ids = self.pool.allocate(num_blocks)
        stamps = self._write(block_ids)
        lease_id = f"lease-{len(self.granted)}"
        self.producer.hand_over(lease_id, block_ids, lease_id, self.now)
        self.pool.free(block_ids)  # the request is done; the lease alone holds them
        self.granted[lease_id] = stamps
        return lease_id

    @rule(num_blocks=st.integers(1, 3))
    def another_request_writes(self, num_blocks: int) -> None:
        """Whatever the pool hands out is overwritten at once."""
        if self.pool.num_free_blocks >= num_blocks:
            block_ids = self.pool.allocate(num_blocks)
            self._write(block_ids)
            self.held += block_ids

    @rule()
    def a_request_ends(self) -> None:
        if self.held:
            self.pool.free([self.held.pop(0)])

    @rule(seconds=st.sampled_from([0.5, 1.0, 2.5]))
    def time_passes(self, seconds: float) -> None:
        self.now += seconds
        self.producer.tick(self.now)  # the engine's step: expired leases end

    @rule(lease_id=leases)
    def the_reader_releases(self, lease_id: str) -> None:
        self.producer.release_later(lease_id)
        self.producer.tick(self.now)

    @rule(target=reads, lease_id=leases)
    def a_transfer_runs(self, lease_id: str):
        """The fake transport: the lease's blocks' bytes, as they are now."""
        block_ids = list(self.granted[lease_id])
        return lease_id, self.kv[block_ids].clone()

    @rule(read=consumes(reads))
    def the_reader_verifies(self, read) -> None:
        lease_id, data = read
        stamps = self.granted[lease_id]
        pairs = self._lease_pairs(lease_id, stamps)
        try:
            expected = self.producer.checksums(lease_id, lease_id, pairs, self.now)
        except KVTransferError as refused:
            assert refused.reason == "lease"
            return
        got = [zlib.crc32(row.contiguous().view(torch.uint8).numpy()) for row in data]
        if got == expected:
            self.num_accepted += 1
            assert data.tolist() == [[stamp] * 8 for stamp in stamps.values()], \
                "a reader accepted bytes that are not the leased ones"

    def _lease_pairs(self, lease_id: str, stamps: dict[int, float]) -> list[tuple[int, int]]:
        lease = self.producer.leases.live_lease(lease_id)
        # A live lease's own generations; an ended one's are unknown to the reader's gate
        # and any generation is refused, so the pool's current one is asked.
        return lease.pairs if lease is not None else [
            (block_id, self.pool.generation(block_id)) for block_id in stamps]

    @invariant()
    def leases_hold(self) -> None:
        self.producer.leases.check_invariants()
        for lease in self.producer.live_leases():
            assert block_checksums([self.kv], lease.block_ids) == [
                zlib.crc32(torch.full((8,), stamp).view(torch.uint8).numpy())
                for stamp in self.granted[lease.lease_id].values()], "a leased block changed"


TestHandover = Handover.TestCase
TestHandover.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)

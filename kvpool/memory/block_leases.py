"""Block leases: the producer's record of the KV blocks it promised to a remote reader.

In disaggregated serving a prefill worker computes a prompt's KV and a decode worker pulls its
blocks over a transfer engine. The classic failure is a send after the producer freed and
reused a block: the reader gets another request's KV and answers, with HTTP 200, wrong text.
A lease rules that out twice over:

- it holds one pool reference on each block it names (`BlockPool.retain`), so while it lives
  none of them can be freed, evicted or handed out again;
- it records each block's generation (`BlockPool.generation`) when granted, and `check`, the
  sender's gate before every send, passes only a live lease, and only pairs it holds whose
  generation is still the pool's.

A lease ends once, whichever comes first: `release` (the reader is done, or the request was
aborted) or `expire` (called once per engine step: a reader that vanished cannot pin memory
for ever). Either way its references are dropped, and a block whose last one goes returns to
the pool, free or cached, as usual. A lease past its expiry refuses every check even before
`expire` sweeps it. Several leases may name one block (two decode workers reading one cached
prefix): each holds its own reference, so each ends on its own. Time is the caller's `now`
(the engine's monotonic clock): nothing here reads a clock.

Invariants (`check_invariants`, and the property test in tests/memory/test_block_leases.py):
- a block's pool ref_count is at least the number of live leases naming it;
- every live lease's pairs are current in the pool (its references keep them so);
- no check passes for a lease that was released, that expired, or that is past its expiry;
- a (block id, generation) pair passes only while that generation is the pool's.

With a lease's reference held, only an elastic shrink could move a leased block to another id
(`ResizableBlockPool.relocate_blocks`). `ElasticKVPool.shrink` refuses that, since a lease is
not a block table; should it happen anyway, the old id's generation has advanced, so `check`
refuses the pair as stale rather than send what the id holds now.

A hybrid pool's groups each keep their own pool and generations: one `BlockLeases` per group
pool, under the same lease id. Not thread-safe: the engine's step thread owns a `BlockLeases`.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import NamedTuple

from kvpool.memory.block_pool import BlockPool

RECENT_ENDS = 4096  # ended lease ids remembered, to tell "released"/"expired" from "unknown"


class LeasedBlock(NamedTuple):
    """One block as promised: its id and its generation when leased (a plain tuple works)."""

    block_id: int
    generation: int


class Refusal(enum.Enum):
    """Why `check` refused a send."""

    UNKNOWN_LEASE = "unknown_lease"  # never granted here, or ended too long ago to remember
    RELEASED = "released"
    EXPIRED = "expired"  # swept by `expire`, or past its expiry at the check
    NOT_IN_LEASE = "not_in_lease"  # a (block id, generation) pair the lease does not hold
    STALE_GENERATION = "stale_generation"  # the pool's generation moved (a relocation)


class ReleaseOutcome(enum.Enum):
    """What `release` did; only RELEASED dropped references."""

    RELEASED = "released"
    ALREADY_RELEASED = "already_released"
    ALREADY_EXPIRED = "already_expired"
    UNKNOWN_LEASE = "unknown_lease"


class LeaseRefused(Exception):
    """A send the lease does not allow; `reason` says why, the message gives the numbers."""

    def __init__(self, reason: Refusal, lease_id: str, detail: str) -> None:
        self.reason = reason
        self.lease_id = lease_id
        super().__init__(f"lease {lease_id!r} refused ({reason.value}): {detail}")


@dataclass(frozen=True, slots=True)
class Lease:
    """Blocks promised to one reader until `expires_at`."""

    lease_id: str
    generations: Mapping[int, int]  # block id -> its generation when leased, in lease order
    expires_at: float

    @property
    def pairs(self) -> list[LeasedBlock]:
        return [LeasedBlock(block_id, gen) for block_id, gen in self.generations.items()]

    @property
    def block_ids(self) -> list[int]:
        return list(self.generations)

    def is_expired(self, now: float) -> bool:
        return now >= self.expires_at


@dataclass(frozen=True, slots=True)
class BlockLeaseStats:
    """Gauges (live now) and counters (since start) for metrics."""

    num_leases: int  # live leases
    num_leased_blocks: int  # references live leases hold (a block two leases name counts twice)
    num_granted: int
    num_released: int
    num_expired: int
    num_checks_passed: int
    num_refusals: dict[Refusal, int]  # every reason, zeros included


_ENDED_DETAIL = {Refusal.UNKNOWN_LEASE: "never granted here, or ended too long ago to recall",
                 Refusal.RELEASED: "it was released", Refusal.EXPIRED: "it expired"}
_OUTCOME_AFTER = {Refusal.RELEASED: ReleaseOutcome.ALREADY_RELEASED,
                  Refusal.EXPIRED: ReleaseOutcome.ALREADY_EXPIRED}


class BlockLeases:
    """The leases one producer holds on `pool`'s blocks, each living `ttl_seconds` at most."""

    def __init__(self, pool: BlockPool, ttl_seconds: float) -> None:
        if not (ttl_seconds > 0 and math.isfinite(ttl_seconds)):
            raise ValueError(f"ttl_seconds must be positive and finite, got {ttl_seconds}")
        self.pool = pool
        self.ttl_seconds = ttl_seconds
        self._live: dict[str, Lease] = {}
        # (expires_at, tiebreak, lease), lazily pruned: a released lease's entry stays until
        # its deadline passes, so the heap holds at most the leases of one ttl.
        self._deadlines: list[tuple[float, int, Lease]] = []
        self._tiebreak = itertools.count()
        self._ended: OrderedDict[str, Refusal] = OrderedDict()  # RELEASED or EXPIRED
        self._num_granted = self._num_released = self._num_expired = 0
        self._num_checks_passed = 0
        self._num_refusals: Counter[Refusal] = Counter()

    # ------------------------------------------------------------------ grant
    def lease(self, lease_id: str, block_ids: Iterable[int], now: float) -> Lease:
        """Promise `block_ids` (used or cached, each once) until `now + ttl_seconds`, holding a
        reference on each. All or nothing: ValueError for a live `lease_id` or a repeated id,
        InvalidBlockError (from the pool) for a free, offline or null block."""
        if lease_id in self._live:
            raise ValueError(f"lease {lease_id!r} is already live")
        block_ids = list(block_ids)
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"lease {lease_id!r} names a block twice: {block_ids}")
        self.pool.retain(block_ids)
        generations = {block_id: self.pool.generation(block_id) for block_id in block_ids}
        lease = Lease(lease_id, MappingProxyType(generations), now + self.ttl_seconds)
        self._live[lease_id] = lease
        self._ended.pop(lease_id, None)
        heapq.heappush(self._deadlines, (lease.expires_at, next(self._tiebreak), lease))
        self._num_granted += 1
        return lease

    # ------------------------------------------------------------------- gate
    def check(self, lease_id: str, pairs: Sequence[tuple[int, int]], now: float) -> Lease:
        """The sender's gate before every send: the lease, if it is live at `now` and holds
        every (block id, generation) of `pairs` at the pool's current generation; otherwise
        LeaseRefused, with the first reason found (the lease's state, then pair by pair)."""
        try:
            lease = self._live_lease(lease_id, now)
            for block_id, generation in pairs:
                self._check_pair(lease, block_id, generation)
        except LeaseRefused as refused:
            self._num_refusals[refused.reason] += 1
            raise
        self._num_checks_passed += 1
        return lease

    def _live_lease(self, lease_id: str, now: float) -> Lease:
        lease = self._live.get(lease_id)
        if lease is None:
            ended = self._ended.get(lease_id, Refusal.UNKNOWN_LEASE)
            raise LeaseRefused(ended, lease_id, _ENDED_DETAIL[ended])
        if lease.is_expired(now):
            raise LeaseRefused(Refusal.EXPIRED, lease_id,
                               f"expired at {lease.expires_at}, now is {now}")
        return lease

    def _check_pair(self, lease: Lease, block_id: int, generation: int) -> None:
        leased = lease.generations.get(block_id)
        if leased != generation:
            held = "not leased" if leased is None else f"leased at generation {leased}"
            raise LeaseRefused(Refusal.NOT_IN_LEASE, lease.lease_id,
                               f"block {block_id} generation {generation}: block {held}")
        current = self.pool.generation(block_id)
        if current != generation:
            raise LeaseRefused(Refusal.STALE_GENERATION, lease.lease_id,
                               f"block {block_id} leased at generation {generation}, "
                               f"the pool's is now {current}")

    # -------------------------------------------------------------------- end
    def release(self, lease_id: str) -> ReleaseOutcome:
        """End a live lease (the reader is done, or the request aborted), dropping its
        references. Idempotent: a lease already ended is left alone and the outcome says how
        it ended."""
        lease = self._live.get(lease_id)
        if lease is None:
            ended = self._ended.get(lease_id)
            return _OUTCOME_AFTER.get(ended, ReleaseOutcome.UNKNOWN_LEASE)
        self._end(lease, Refusal.RELEASED)
        self._num_released += 1
        return ReleaseOutcome.RELEASED

    def expire(self, now: float) -> list[str]:
        """End every live lease past its expiry at `now` (once per engine step); their ids,
        soonest deadline first."""
        expired: list[str] = []
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, lease = heapq.heappop(self._deadlines)
            if self._live.get(lease.lease_id) is lease:  # else released, or granted anew
                self._end(lease, Refusal.EXPIRED)
                expired.append(lease.lease_id)
        self._num_expired += len(expired)
        return expired

    def _end(self, lease: Lease, why: Refusal) -> None:
        # Tail first, so cached blocks join the LRU tail first (`BlockPool.free`).
        self.pool.free(reversed(lease.block_ids))
        del self._live[lease.lease_id]
        self._ended[lease.lease_id] = why
        if len(self._ended) > RECENT_ENDS:
            self._ended.popitem(last=False)

    # -------------------------------------------------------------- reporting
    def live_lease(self, lease_id: str) -> Lease | None:
        """The live lease `lease_id`, or None (never granted, or ended)."""
        return self._live.get(lease_id)

    def live_leases(self) -> list[Lease]:
        """The live leases, oldest grant first."""
        return list(self._live.values())

    def stats(self) -> BlockLeaseStats:
        return BlockLeaseStats(
            num_leases=len(self._live),
            num_leased_blocks=sum(len(lease.generations) for lease in self._live.values()),
            num_granted=self._num_granted,
            num_released=self._num_released,
            num_expired=self._num_expired,
            num_checks_passed=self._num_checks_passed,
            num_refusals={reason: self._num_refusals[reason] for reason in Refusal},
        )

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants on the pool (O(leased blocks); tests)."""
        holders = Counter(b for lease in self._live.values() for b in lease.generations)
        for block_id, num_leases in holders.items():
            assert self.pool.ref_count(block_id) >= num_leases, f"block {block_id} under-held"
        for lease in self._live.values():
            for block_id, generation in lease.generations.items():
                assert self.pool.generation(block_id) == generation, f"leased {block_id} moved"
            assert lease.lease_id not in self._ended, "a live lease is recorded as ended"
        pending = {id(lease) for _, _, lease in self._deadlines}
        assert all(id(lease) in pending for lease in self._live.values()), "a lease never ends"
        assert self._num_granted - self._num_released - self._num_expired == len(self._live)

"""What the shared tier remembers of Redis's contents, so the engine thread need not ask again.

    known    hashes known to be in Redis (written by this process, found by EXISTS, or
             loaded), least recently used first, at most `max_size`
    missing  hashes EXISTS found absent, each until its expiry (`ttl` seconds later), at most
             `max_size`

A known hash may be stale (Redis's LRU evicted it, or Redis restarted): the MGET that misses it
makes it missing. A missing one goes the moment this process writes it (`forget_missing`).

Invariants (`check_invariants`): known and missing are disjoint, each within `max_size`.
Not thread-safe: the shared tier calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict

from kvpool.memory.prefix_cache import BlockHash


class PresenceMemo:
    """Known-present hashes (bounded LRU) and known-absent ones (bounded, with a TTL)."""

    def __init__(self, max_size: int, ttl: float) -> None:
        if max_size < 1 or ttl < 0:
            raise ValueError(f"max_size ({max_size}) must be >= 1 and ttl ({ttl}) >= 0")
        self.max_size = max_size
        self.ttl = ttl
        self._known: OrderedDict[BlockHash, None] = OrderedDict()
        self._missing: OrderedDict[BlockHash, float] = OrderedDict()  # → expiry (monotonic)

    def __len__(self) -> int:
        return len(self._known)

    def is_known(self, block_hash: BlockHash) -> bool:
        return block_hash in self._known

    def lookup(self, block_hash: BlockHash, now: float) -> bool | None:
        """True (known), False (missing, not expired), or None (ask Redis)."""
        if block_hash in self._known:
            self._known.move_to_end(block_hash)
            return True
        expiry = self._missing.get(block_hash)
        if expiry is None:
            return None
        if expiry > now:
            return False
        del self._missing[block_hash]
        return None

    def remember(self, block_hash: BlockHash, is_present: bool, now: float) -> None:
        if is_present:
            self._missing.pop(block_hash, None)
            self._known[block_hash] = None
            self._known.move_to_end(block_hash)
            if len(self._known) > self.max_size:
                self._known.popitem(last=False)
            return
        self._known.pop(block_hash, None)
        if self.ttl > 0:  # inserted last: the dict stays in expiry order, soonest first
            self._missing.pop(block_hash, None)
            self._missing[block_hash] = now + self.ttl
            if len(self._missing) > self.max_size:
                self._missing.popitem(last=False)

    def forget_missing(self, block_hash: BlockHash) -> None:
        self._missing.pop(block_hash, None)

    def clear(self) -> None:
        self._known.clear()
        self._missing.clear()

    def check_invariants(self) -> None:
        assert self._known.keys().isdisjoint(self._missing), "known and missing overlap"
        assert len(self._known) <= self.max_size and len(self._missing) <= self.max_size, (
            f"{len(self._known)} known, {len(self._missing)} missing, bound {self.max_size}")

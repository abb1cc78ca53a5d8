"""The engine's side of the KV events (wire format: `kvpool.formats.kv_events`).

`KVEventLog`, the engine's side, hears each attached pool through a `KVListener`
(`kvpool.memory.kv_listener`) on the pool's fan-out: every block published into its prefix
cache, every hashed block evicted (for reuse, by an elastic shrink, or taken by another group of
a hybrid pool) and every reset, each under the medium events name the pool by (its medium and
KV cache group: `kvpool.formats.kv_media.group_medium`). The first pool attached (the device's
first group) brings the step's end too, when the batch is drained.
Invariants:
- `seq` is the number of non-empty batches drained: 1 for the first, per engine.
- Applying every drained batch, in order, to empty per-medium sets gives exactly the hashes
  the attached pools' prefix caches hold as of the last drain; `snapshot` drains first, so
  its blocks are those sets and its `seq` the last batch they include.
- A BlockStored's `token_ids` are empty unless `config.include_token_ids`: hashes only.
- `_parent_by_hash` knows the parent of every hash an attached pool holds that this log heard
  published (so a host spill names its parent); hashes no pool holds are pruned at each drain.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from kvpool.engine.observability.events_config import KVEventsConfig
from kvpool.formats.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSnapshot,
    KVEventBatch,
)
from kvpool.formats.kv_media import group_medium
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.kv_listener import KVListener
from kvpool.memory.prefix_cache import BlockHash, CachedBlock

__all__ = ["EventPublisher", "KVEventLog", "PublisherStats"]


@dataclass(frozen=True, slots=True)
class PublisherStats:
    num_batches_published: int
    num_events_published: int
    num_batches_dropped: int  # the queue was full (oldest dropped), or published after close


class EventPublisher(Protocol):
    name: str  # the config's `publisher`
    endpoint: str | None  # the address bound (zmq.LAST_ENDPOINT); None: nothing bound
    curve_public_key: str | None  # Z85: subscribers must use CURVE with it; None: no CURVE

    def publish(self, seq: int, batch: KVEventBatch) -> None: ...

    def stats(self) -> PublisherStats: ...

    def close(self) -> None: ...


class KVEventLog:
    """One engine's KV events: the batch the current step builds, numbered at `drain`."""

    def __init__(self, config: KVEventsConfig, block_size: int,
                 publisher: EventPublisher) -> None:
        self.config = config
        self.block_size = block_size
        # Prompts leave the process only when the operator asks (`include_token_ids`).
        self._includes_token_ids = config.include_token_ids
        self.publisher = publisher
        self.seq = 0
        self._pools: dict[str, BlockPool] = {}  # by the medium events name
        self._ears: dict[str, _PoolEars] = {}
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._parent_by_hash: dict[BlockHash, BlockHash | None] = {}
        self._removed: list[BlockHash] = []  # since the last drain: candidates to prune

    def attach(self, pool: BlockPool, group: int = 0) -> None:
        """Hear `pool` from now on, as tier `pool.medium` of KV cache group `group` (one pool
        per medium and group)."""
        medium = group_medium(pool.medium, group)
        assert medium not in self._pools, f"a {medium} pool is already attached"
        self._pools[medium] = pool
        self._ears[medium] = _PoolEars(self, medium, hears_steps=len(self._pools) == 1)
        pool.listeners.add(self._ears[medium])

    # ------------------------------------------------------------ the pools' side
    # (each with the medium events name the pool by, from its `_PoolEars`)
    def block_stored(self, medium: str, block_id: int, block_hash: BlockHash,
                     parent_hash: BlockHash | None, token_ids: Sequence[int]) -> None:
        if parent_hash is None:  # a first block, or a spill: the parent it was published with
            parent_hash = self._parent_by_hash.get(block_hash)
        self._parent_by_hash[block_hash] = parent_hash
        events = self._events
        last = events[-1] if events else None
        if (type(last) is BlockStored and last.medium == medium
                and last.block_hashes[-1] == parent_hash):  # the run goes on
            last.block_hashes.append(block_hash)
            if self._includes_token_ids:
                last.token_ids.extend(token_ids)
            return
        tokens = list(token_ids) if self._includes_token_ids else []
        events.append(BlockStored([block_hash], parent_hash, tokens, self.block_size, None,
                                  medium))

    def block_evicted(self, medium: str, block_id: int, entry: CachedBlock,
                      is_kv_intact: bool) -> None:
        self._removed_from(medium, entry.block_hash)

    def block_removed(self, medium: str, block_id: int, block_hash: BlockHash) -> None:
        self._removed_from(medium, block_hash)

    def _removed_from(self, medium: str, block_hash: BlockHash) -> None:
        self._removed.append(block_hash)
        events = self._events
        last = events[-1] if events else None
        if type(last) is BlockRemoved and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            events.append(BlockRemoved([block_hash], medium))

    def pool_cleared(self, medium: str) -> None:
        """AllBlocksCleared when every other tier is empty too, else this tier's removals
        (a consumer clears a replica's every tier on AllBlocksCleared)."""
        others = [pool for name, pool in self._pools.items() if name != medium]
        if any(len(pool.prefix_cache) for pool in others):
            for block_hash in list(self._pools[medium].prefix_cache.block_hashes()):
                self._removed_from(medium, block_hash)
            return
        if not self._events or type(self._events[-1]) is not AllBlocksCleared:
            self._events.append(AllBlocksCleared())
        self._parent_by_hash.clear()
        self._removed.clear()

    # ------------------------------------------------------------ the engine's side
    def drain(self) -> None:
        """Number the step's batch and hand it to the publisher (nothing when empty)."""
        if not self._events:
            return
        events, self._events = self._events, []
        self._prune_parents()
        self.seq += 1
        self.publisher.publish(self.seq, KVEventBatch(time.time(), events))

    def snapshot(self) -> EventSnapshot:
        """What every attached pool holds now, after draining (so `seq` is exact)."""
        self.drain()
        blocks = [(block_hash, medium) for medium, pool in self._pools.items()
                  for block_hash in pool.prefix_cache.block_hashes()]
        return EventSnapshot(self.seq, blocks)

    def close(self) -> None:
        """Publish what is pending, close the publisher and stop hearing the pools
        (idempotent)."""
        self.drain()
        self.publisher.close()
        for medium, pool in self._pools.items():
            if self._ears[medium] in pool.listeners:
                pool.listeners.remove(self._ears[medium])

    def _prune_parents(self) -> None:
        removed, self._removed = self._removed, []
        pools = self._pools.values()
        for block_hash in removed:
            if not any(pool.prefix_cache.holds(block_hash) for pool in pools):
                self._parent_by_hash.pop(block_hash, None)


class _PoolEars(KVListener):
    """One attached pool's listener: what the pool says, passed on to the log under the
    medium events name it by; the first pool's also passes on the step's end."""

    def __init__(self, log: KVEventLog, medium: str, hears_steps: bool) -> None:
        self.log = log
        self.medium = medium
        self.hears_steps = hears_steps

    def block_stored(self, medium: str, block_id: int, block_hash: BlockHash,
                     parent_hash: BlockHash | None, token_ids: Sequence[int]) -> None:
        self.log.block_stored(self.medium, block_id, block_hash, parent_hash, token_ids)

    def block_evicted(self, medium: str, block_id: int, entry: CachedBlock,
                      is_kv_intact: bool) -> None:
        self.log.block_evicted(self.medium, block_id, entry, is_kv_intact)

    def block_removed(self, medium: str, block_id: int, block_hash: BlockHash) -> None:
        self.log.block_removed(self.medium, block_id, block_hash)

    def pool_cleared(self, medium: str) -> None:
        self.log.pool_cleared(self.medium)

    def step_ended(self, next_step: int) -> None:
        if self.hears_steps:
            self.log.drain()

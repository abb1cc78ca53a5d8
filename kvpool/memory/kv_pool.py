"""What the engine asks of its KV pool's size, and the pool that never changes it.

Both pool modes lay the KV tensor over one arena reservation (`kvpool.memory.arena`), made once
at start-up, and both answer the same calls (`KVPool`), so nothing above them asks which it is:

- `StaticKVPool` (`--kv-pool static`): one arena allocation holding every block (the null block
  first), all online from the start. It never grows or shrinks: the null object of the elastic
  pool.
- `ElasticKVPool` (`--kv-pool elastic`, `kvpool.memory.elastic_pool`): segments taken under
  pressure and given back when idle.

`kvpool.memory.kv_memory.KVMemory` builds one of them and is the engine's only handle on it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpool.memory.arena_stats import ArenaStats
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.block_table import BlockTable

if TYPE_CHECKING:
    from kvpool.memory.arena import Arena
    from kvpool.memory.kv_cache import KVCache

KV_POOL_MODES = ("static", "elastic")


@dataclass(frozen=True, slots=True)
class KVPoolStats:
    """A snapshot of the pool's memory; counters count since start-up (or the warm-up)."""

    mode: str  # "static" or "elastic"
    num_online_blocks: int
    max_num_blocks: int  # online plus what the arena could still bring online
    num_segments: int
    bytes_per_block: int
    num_grows: int
    num_shrinks: int
    num_migrated_blocks: int  # used blocks copied to another segment by shrinks
    num_evicted_blocks: int  # unreferenced cached blocks dropped by shrinks
    arena: ArenaStats


class KVPool(Protocol):
    """What the engine asks of its KV memory, static or elastic."""

    pool: BlockPool
    kv_cache: KVCache
    arena: Arena

    @property
    def max_num_blocks(self) -> int:
        """Blocks the pool holds at its largest: what a single sequence can ever use."""
        ...

    def grow(self) -> bool:
        """Bring one more segment online; False when the budget is exhausted."""
        ...

    def shrink(self, block_tables: Iterable[BlockTable]) -> bool:
        """Give the emptiest segment back, remapping `block_tables` (every live table)."""
        ...

    def maybe_resize(self, now: float, block_tables: Iterable[BlockTable]) -> None:
        """Apply the grow/shrink policy; `now` in seconds (time.monotonic)."""
        ...

    def reset(self) -> None:
        """With no block used: back to the start-up state, counters zero (after a warm-up)."""
        ...

    def stats(self) -> KVPoolStats: ...

    def check_invariants(self) -> None:
        """Assert the pool's invariants and its block pool's (for tests)."""
        ...


class StaticKVPool:
    """Every block online from the start, in one arena allocation; never resizes."""

    def __init__(self, pool: BlockPool, kv_cache: KVCache, arena: Arena) -> None:
        self.pool = pool
        self.kv_cache = kv_cache
        self.arena = arena
        kv_cache.tensor.zero_()

    @property
    def max_num_blocks(self) -> int:
        return self.pool.num_blocks

    def grow(self) -> bool:
        return False

    def shrink(self, block_tables: Iterable[BlockTable]) -> bool:
        return False

    def maybe_resize(self, now: float, block_tables: Iterable[BlockTable]) -> None:
        return None

    def reset(self) -> None:
        self.pool.reset()

    def stats(self) -> KVPoolStats:
        return KVPoolStats("static", self.pool.num_blocks, self.pool.num_blocks, 1,
                           self.pool.layout.bytes_per_block, 0, 0, 0, 0, self.arena.stats())

    def check_invariants(self) -> None:
        assert self.kv_cache.num_blocks == self.pool.capacity_blocks
        self.pool.check_invariants()



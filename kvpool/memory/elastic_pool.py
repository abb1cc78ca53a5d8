"""The KV pool's memory: which block ids are online, and how that changes while the engine runs.

Both modes lay the KV tensor over one arena reservation (`kvpool.memory.arena`), made once at
start-up, and both answer the same calls (`KVPool`), so the engine never asks which it has:

- `StaticKVPool` (`--kv-pool static`): one arena allocation holding every block, all online
  from the start. It never grows or shrinks: the null object of the elastic pool.
- `ElasticKVPool` (`--kv-pool elastic`): the KV tensor views the *whole* arena as
  `[capacity_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, but only the blocks
  of *segments* are online in the block pool. A segment is one exact arena allocation of up to
  `segment_blocks` blocks aligned to a block's size, so its ids are one run and
  block id = byte offset / bytes_per_block:

        arena bytes   | segment: ids 0..127 | segment: ids 128..255 | free ..................|
        KV tensor     [ block 0 ......................................... capacity_blocks - 1 ]
        block pool      online: 0..255                               offline: 256..

Policy (`maybe_resize`, which the engine calls between steps, never inside one):
- grow by a segment when fewer than `low_watermark_blocks` blocks are allocatable, while the
  arena has room; the engine's KV manager also grows on demand (`grow`) before it would
  preempt a sequence or refuse admission;
- shrink when at least a segment's blocks plus the watermark have been allocatable without a
  break for `idle_seconds`, one segment per idle period, never below the initial segments
  (`initial_blocks` is both the pre-allocation and the floor; 0 gives everything back).

Shrink (`shrink`) empties the segment with the fewest used blocks (ties: the highest ids):
its free blocks go offline; its cached blocks that no table holds are *evicted*, not moved
(they are a cache, and moving them would cost a copy for data nobody holds); each used block is
relocated into a free block of another segment (K/V copied by `KVCache.copy_blocks`, references
and prefix-cache entry moved, every live block table remapped); then the segment's range goes
back to the arena. Memory given back stays in the arena's one reservation, ready for the next
grow; it is not returned to the device allocator.

Invariants:
- The online ids are exactly the union of the segments' runs (static: every id).
- A segment's bytes are zeroed when it comes online, and block 0's when the pool is made:
  attention reads (and masks) never-written slots and zero-padded table entries (block 0), and
  a stale NaN bit pattern would survive the mask (0 * NaN = NaN).
- Resizes happen only between steps, so no step's slot mapping or block copy refers to an id
  that moves.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from kvpool.memory.arena_free_list import FreeRange, align_up
from kvpool.memory.arena_stats import ArenaStats
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.block_table import BlockCopy, BlockTable

if TYPE_CHECKING:
    from kvpool.memory.arena import Arena, ArenaHandle
    from kvpool.memory.kv_cache import KVCache

KV_POOL_MODES = ("static", "elastic")


@dataclass(frozen=True, slots=True)
class ElasticPoolConfig:
    """How an elastic pool sizes itself; block counts are KV blocks."""

    segment_blocks: int = 128
    initial_blocks: int | None = None  # online at start and at least (whole segments); None: one
    idle_seconds: float = 10.0
    low_watermark_blocks: int = 0

    def __post_init__(self) -> None:
        if self.segment_blocks < 1:
            raise ValueError(f"segment_blocks must be >= 1, got {self.segment_blocks}")
        if self.initial_blocks is not None and self.initial_blocks < 0:
            raise ValueError(f"initial_blocks must be >= 0, got {self.initial_blocks}")
        if self.idle_seconds < 0 or self.low_watermark_blocks < 0:
            raise ValueError("idle_seconds and low_watermark_blocks must be >= 0")


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
                           self.kv_cache.bytes_per_block, 0, 0, 0, 0, self.arena.stats())


@dataclass(frozen=True, slots=True)
class Segment:
    """One arena allocation whose blocks are online: ids `first_block_id ..` + num_blocks."""

    handle: ArenaHandle
    first_block_id: int
    num_blocks: int

    @property
    def block_ids(self) -> range:
        return range(self.first_block_id, self.first_block_id + self.num_blocks)


class ElasticKVPool:
    """Segments of KV blocks taken from the arena under pressure and given back when idle."""

    def __init__(self, pool: BlockPool, kv_cache: KVCache, arena: Arena,
                 config: ElasticPoolConfig | None = None) -> None:
        """`kv_cache` must view the arena buffer from byte 0 (block id = offset / block size),
        and `pool` must start with no block online."""
        assert kv_cache.tensor.data_ptr() == arena.buffer.data_ptr(), "KV must view the arena"
        assert pool.num_blocks == 0 and pool.capacity_blocks == kv_cache.num_blocks
        self.pool = pool
        self.kv_cache = kv_cache
        self.arena = arena
        self.config = config or ElasticPoolConfig()
        self.bytes_per_block = kv_cache.bytes_per_block
        self._segments: list[Segment] = []
        self._idle_since: float | None = None
        arena.buffer[: self.bytes_per_block].zero_()  # block 0: the padding id attention reads
        initial = self.config.initial_blocks
        if initial is None:  # one segment, or the whole budget when it is smaller
            initial = min(self.config.segment_blocks, self.max_num_blocks)
        if initial > self.max_num_blocks:
            raise ValueError(f"initial_blocks={initial} exceeds the {self.max_num_blocks} "
                             "blocks the KV budget holds")
        while self.pool.num_blocks < initial:
            self._add_segment(self._next_segment_blocks())
        self._num_initial_segments = len(self._segments)
        self._reset_counters()

    def _reset_counters(self) -> None:
        self._num_grows = 0
        self._num_shrinks = 0
        self._num_migrated_blocks = 0
        self._num_evicted_blocks = 0

    # ---------------------------------------------------------------- queries
    @property
    def segments(self) -> list[Segment]:
        return list(self._segments)

    @property
    def max_num_blocks(self) -> int:
        free_ranges = self.arena.free_ranges()
        return self.pool.num_blocks + sum(self._num_blocks_fitting(r) for r in free_ranges)

    def _num_blocks_fitting(self, free: FreeRange, limit: int | None = None) -> int:
        """Blocks that segments carved one after another from `free` would hold (at most
        `limit` when given: the size of the one next segment)."""
        base = self.arena.config.alignment
        alignment = math.lcm(self.bytes_per_block, base)
        offset, total = free.offset, 0
        while limit is None or total < limit:
            start = align_up(offset, alignment)
            room = free.end - start
            num_blocks = min(self.config.segment_blocks, max(room, 0) // self.bytes_per_block)
            if num_blocks and align_up(num_blocks * self.bytes_per_block, base) > room:
                num_blocks -= 1  # the range is rounded up to the arena's base alignment
            if num_blocks == 0:
                break
            total += num_blocks
            offset = start + align_up(num_blocks * self.bytes_per_block, base)
        return total if limit is None else min(total, limit)

    def _next_segment_blocks(self) -> int:
        """The size of the next segment: `segment_blocks`, or what is left (0: nothing)."""
        limit = self.config.segment_blocks
        return max((self._num_blocks_fitting(r, limit) for r in self.arena.free_ranges()),
                   default=0)

    # ------------------------------------------------------------ grow/shrink
    def grow(self) -> bool:
        num_blocks = self._next_segment_blocks()
        if num_blocks == 0:
            return False
        self._add_segment(num_blocks)
        self._num_grows += 1
        return True

    def _add_segment(self, num_blocks: int) -> None:
        nbytes = num_blocks * self.bytes_per_block
        handle = self.arena.allocate(nbytes, alignment=self.bytes_per_block, size_class=False)
        self.arena.buffer[handle.offset : handle.offset + nbytes].zero_()
        segment = Segment(handle, handle.offset // self.bytes_per_block, num_blocks)
        self.pool.add_blocks(segment.block_ids)
        self._segments.append(segment)

    def shrink(self, block_tables: Iterable[BlockTable]) -> bool:
        """Migrate the emptiest segment's used blocks elsewhere and give the segment back.

        `block_tables` must be every table holding a block (ValueError otherwise, before any
        change). Returns False, changing nothing, when no segment can go: there is none, or
        the other segments lack free blocks for its used ones.
        """
        segment = self._emptiest_segment()
        if segment is None:
            return False
        used_ids = [b for b in segment.block_ids if self.pool.ref_count(b)]
        tables = list(block_tables)
        self._check_tables_hold(tables, segment, used_ids)
        if self.pool.num_allocatable_blocks < segment.num_blocks:
            return False  # the other segments cannot take the used blocks
        unused_ids = [b for b in segment.block_ids if not self.pool.ref_count(b)]
        self._num_evicted_blocks += self.pool.remove_blocks(unused_ids)
        old_to_new = self.pool.relocate_blocks(used_ids)
        self.kv_cache.copy_blocks([BlockCopy(old, new) for old, new in old_to_new.items()])
        for table in tables:
            table.remap(old_to_new)
        self.pool.remove_blocks(used_ids)
        self.arena.free(segment.handle)
        self._segments.remove(segment)
        self._num_shrinks += 1
        self._num_migrated_blocks += len(used_ids)
        return True

    def _emptiest_segment(self) -> Segment | None:
        """Fewest used blocks; ties go to the highest ids, keeping the arena's low end dense."""
        def order(segment: Segment) -> tuple[int, int]:
            num_used = sum(1 for b in segment.block_ids if self.pool.ref_count(b))
            return num_used, -segment.first_block_id

        return min(self._segments, key=order, default=None)

    def _check_tables_hold(self, tables: list[BlockTable], segment: Segment,
                           used_ids: list[int]) -> None:
        """Every reference to the segment's used blocks must come from one of `tables`, or
        a table we were not shown would keep an id that goes offline."""
        ids = segment.block_ids
        held = Counter(b for table in tables for b in table.block_ids if b in ids)
        if any(held[b] != self.pool.ref_count(b) for b in used_ids) or len(held) != len(used_ids):
            raise ValueError("shrink needs every live block table: the tables given do not "
                             "account for the references to the segment's blocks")

    def maybe_resize(self, now: float, block_tables: Iterable[BlockTable]) -> None:
        num_allocatable = self.pool.num_allocatable_blocks
        watermark = self.config.low_watermark_blocks
        if num_allocatable < watermark:
            self._idle_since = None
            self.grow()
            return
        smallest = min((segment.num_blocks for segment in self._segments), default=0)
        if len(self._segments) <= self._num_initial_segments or (
            num_allocatable < smallest + watermark
        ):
            self._idle_since = None  # nothing to spare: the idle clock restarts
            return
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.config.idle_seconds:
            return
        segment = self._emptiest_segment()
        if segment is not None and num_allocatable >= segment.num_blocks + watermark:
            self.shrink(block_tables)
        self._idle_since = now  # the next segment waits for an idle period of its own

    def reset(self) -> None:
        """Give back the segments grown since start-up (none may hold a used block), reset
        the block pool, zero the counters."""
        while len(self._segments) > self._num_initial_segments:
            is_shrunk = self.shrink(())
            assert is_shrunk, "reset needs a pool with no used blocks"
        self.pool.reset()
        self._idle_since = None
        self._reset_counters()

    # -------------------------------------------------------------- reporting
    def stats(self) -> KVPoolStats:
        return KVPoolStats("elastic", self.pool.num_blocks, self.max_num_blocks,
                           len(self._segments), self.bytes_per_block, self._num_grows,
                           self._num_shrinks, self._num_migrated_blocks,
                           self._num_evicted_blocks, self.arena.stats())

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants on ids (O(capacity); for tests)."""
        segment_ids = sorted(b for segment in self._segments for b in segment.block_ids)
        assert segment_ids == self.pool.online_block_ids(), "online ids != segment ids"
        for segment in self._segments:
            assert segment.handle.is_live
            assert segment.handle.offset == segment.first_block_id * self.bytes_per_block
        self.pool.check_invariants()

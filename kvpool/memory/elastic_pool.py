"""The elastic KV pool (`--kv-pool elastic`): blocks come online a segment at a time under
pressure and go back to the arena when idle.

The KV tensor views the *whole* arena as
`[capacity_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`, but only the blocks of
*segments* are online in the block pool. A segment is one exact arena allocation of up to
`segment_blocks` blocks aligned to a block's size, so its ids are one run and
block id = byte offset / kv_bytes_per_block. (A quantized layout's scales live in the KV
cache's scale tensor, which spans the whole capacity and is indexed by the same ids; the arena
holds the codes only.) The arena's first block is the null block:

    arena bytes   | null | segment: ids 1..128 | segment: ids 129..256 | free ...............|
    KV tensor     [ 0    | 1 ........................................... capacity_blocks - 1 ]
    block pool      never  online: 1..256                                offline: 257..

Policy (`maybe_resize`, which the engine calls between steps, never inside one):
- grow by a segment when fewer than `low_watermark_blocks` blocks are allocatable, while the
  arena has room; the engine's KV manager also grows on demand (`grow`) before it would
  preempt a sequence or refuse admission;
- shrink when at least a segment's blocks plus the watermark have been allocatable without a
  break for `idle_seconds`, one segment per idle period, never below the blocks online at
  start (`initial_blocks`, rounded up to whole segments, is both the pre-allocation and the
  floor; 0 gives everything back).

Shrink (`shrink`) empties the segment with the fewest used blocks (ties: the highest ids):
its free blocks go offline; its cached blocks that no table holds are *evicted*, not moved
(they are a cache, and moving them would cost a copy for data nobody holds); each used block is
relocated into a free block of another segment (K/V copied by `KVCache.copy_blocks`, references
and prefix-cache entry moved, every live block table remapped); then the segment's range goes
back to the arena. Memory given back stays in the arena's one reservation, ready for the next
grow; it is not returned to the device allocator.

`reset` returns the pool to its start-up state exactly: every segment is given back and the
initial ones are taken again, so the same ids are online, in the same free order.

The pool's listeners (`kvpool.memory.kv_listener`; the `--kv-trace` recorder) hear every
`grow` and `shrink` as one `pool_resized`: online blocks after, blocks added (negative:
removed), {old id: new id} of the used blocks relocated, and the cached blocks dropped; the
start-up segments and `reset` are not reported. Before a grow, shrink or reset touches any
block's bytes they hear `pool_resizing`: the KV tiers then make the compute stream (where the
relocation copies and the zeroing run) wait for their side-stream copies still in flight.

Invariants:
- The arena's first block-sized range is the null block (id 0), zeroed, held for the pool's
  life and never online (static: the null block is row 0 of the one allocation).
- The online ids are exactly the union of the segments' runs (static: every id but 0).
- A segment's bytes are zeroed when it comes online: attention reads (and masks) the
  never-written slots of a sequence's last block, and a stale NaN bit pattern would survive the
  mask (0 * NaN = NaN).
- Resizes happen only between steps, so no step's slot mapping or block copy refers to an id
  that moves.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.memory.arena_free_list import FreeRange, align_up
from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.block_table import BlockCopy, BlockTable
from kvpool.memory.kv_pool import KVPoolStats
from kvpool.memory.resizable_block_pool import ResizableBlockPool

if TYPE_CHECKING:
    from kvpool.memory.arena import Arena, ArenaHandle
    from kvpool.memory.kv_cache import KVCache


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

    def __init__(self, pool: ResizableBlockPool, kv_cache: KVCache, arena: Arena,
                 config: ElasticPoolConfig | None = None) -> None:
        """`kv_cache` must view the whole, still empty arena buffer from byte 0 (block id =
        offset / block size), and `pool` must start with no block online. The arena's first
        block becomes the null block."""
        assert kv_cache.tensor.data_ptr() == arena.buffer.data_ptr(), "KV must view the arena"
        assert pool.num_blocks == 0 and pool.capacity_blocks == kv_cache.num_blocks
        self.pool = pool
        self.kv_cache = kv_cache
        self.arena = arena
        self.config = config or ElasticPoolConfig()
        self.kv_bytes_per_block = pool.layout.kv_bytes_per_block  # the arena's unit (no scales)
        null_block = arena.allocate(self.kv_bytes_per_block, alignment=self.kv_bytes_per_block)
        assert null_block.offset == NULL_BLOCK_ID * self.kv_bytes_per_block, "arena not empty"
        self._segments: list[Segment] = []
        self._idle_since: float | None = None
        initial = self.config.initial_blocks
        if initial is None:  # one segment, or the whole budget when it is smaller
            initial = min(self.config.segment_blocks, self.max_num_blocks)
        if initial > self.max_num_blocks:
            raise ValueError(f"initial_blocks={initial} exceeds the {self.max_num_blocks} "
                             "blocks the KV budget holds")
        while self.pool.num_blocks < initial:
            self._add_segment(self._next_segment_blocks())
        self._initial_segment_blocks = [segment.num_blocks for segment in self._segments]
        self._num_initial_blocks = self.pool.num_blocks  # the floor no shrink goes below
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
        alignment = math.lcm(self.kv_bytes_per_block, base)
        offset, total = free.offset, 0
        while limit is None or total < limit:
            start = align_up(offset, alignment)
            room = free.end - start
            num_blocks = min(self.config.segment_blocks,
                             max(room, 0) // self.kv_bytes_per_block)
            if num_blocks and align_up(num_blocks * self.kv_bytes_per_block, base) > room:
                num_blocks -= 1  # the range is rounded up to the arena's base alignment
            if num_blocks == 0:
                break
            total += num_blocks
            offset = start + align_up(num_blocks * self.kv_bytes_per_block, base)
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
        self.pool.listeners.pool_resizing(self.pool.medium)  # the segment's bytes are zeroed
        self._add_segment(num_blocks)
        self._num_grows += 1
        self.pool.listeners.pool_resized(self.pool.medium, self.pool.num_blocks, num_blocks,
                                         {}, [])
        return True

    def _add_segment(self, num_blocks: int) -> None:
        nbytes = num_blocks * self.kv_bytes_per_block
        handle = self.arena.allocate(nbytes, alignment=self.kv_bytes_per_block)
        self.arena.buffer[handle.offset : handle.offset + nbytes].zero_()
        segment = Segment(handle, handle.offset // self.kv_bytes_per_block, num_blocks)
        self.pool.add_blocks(segment.block_ids)
        self._segments.append(segment)

    def _remove_segment(self, segment: Segment, block_ids: Iterable[int]) -> None:
        """Take `block_ids`, the segment's blocks still online and none of them used, offline
        (cached ones are evicted) and give the segment's range back to the arena."""
        self._num_evicted_blocks += self.pool.remove_blocks(block_ids)
        self.arena.free(segment.handle)
        self._segments.remove(segment)

    def shrink(self, block_tables: Iterable[BlockTable], min_online_blocks: int = 0) -> bool:
        """Migrate the emptiest segment's used blocks elsewhere and give the segment back,
        keeping at least `min_online_blocks` online.

        `block_tables` must be every table holding a block (ValueError otherwise, before any
        change). Returns False, changing nothing, when no segment can go: there is none small
        enough, or the other segments lack free blocks for its used ones.
        """
        segment = self._emptiest_segment(min_online_blocks)
        if segment is None:
            return False
        used_ids = [b for b in segment.block_ids if self.pool.ref_count(b)]
        tables = list(block_tables)
        self._check_tables_hold(tables, segment, used_ids)
        if self.pool.num_allocatable_blocks < segment.num_blocks:
            return False  # the other segments cannot take the used blocks
        self.pool.listeners.pool_resizing(self.pool.medium)  # copies in flight go first
        # Unused blocks go offline first, so relocation cannot pick them as destinations.
        unused_ids = [b for b in segment.block_ids if not self.pool.ref_count(b)]
        dropped = [b for b in unused_ids if self.pool.is_evictable(b)]
        self._num_evicted_blocks += self.pool.remove_blocks(unused_ids)
        old_to_new = self.pool.relocate_blocks(used_ids)
        self.kv_cache.copy_blocks([BlockCopy(old, new) for old, new in old_to_new.items()])
        for table in tables:
            table.remap(old_to_new)
        self._remove_segment(segment, used_ids)
        self._num_shrinks += 1
        self._num_migrated_blocks += len(used_ids)
        self.pool.listeners.pool_resized(self.pool.medium, self.pool.num_blocks,
                                         -segment.num_blocks, old_to_new, dropped)
        return True

    def _emptiest_segment(self, min_online_blocks: int) -> Segment | None:
        """Of the segments that can go while `min_online_blocks` stay online: the fewest used
        blocks; ties go to the highest ids, keeping the arena's low end dense."""
        spare = self.pool.num_blocks - min_online_blocks

        def order(segment: Segment) -> tuple[int, int]:
            num_used = sum(1 for b in segment.block_ids if self.pool.ref_count(b))
            return num_used, -segment.first_block_id

        candidates = [segment for segment in self._segments if segment.num_blocks <= spare]
        return min(candidates, key=order, default=None)

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
        spare = self.pool.num_blocks - self._num_initial_blocks
        if not self._segments or smallest > spare or num_allocatable < smallest + watermark:
            self._idle_since = None  # nothing to spare: the idle clock restarts
            return
        if self._idle_since is None:
            self._idle_since = now
        if now - self._idle_since < self.config.idle_seconds:
            return
        segment = self._emptiest_segment(self._num_initial_blocks)
        if segment is not None and num_allocatable >= segment.num_blocks + watermark:
            self.shrink(block_tables, self._num_initial_blocks)
        self._idle_since = now  # the next segment waits for an idle period of its own

    def reset(self) -> None:
        """Back to the start-up state (no block may be used): every segment given back and
        the initial ones taken again, so the same ids are online in the same free order; the
        block pool reset, the counters zero."""
        if self.pool.num_used_blocks:
            raise ValueError(f"cannot reset with {self.pool.num_used_blocks} blocks in use")
        self.pool.listeners.pool_resizing(self.pool.medium)
        for segment in list(self._segments):
            self._remove_segment(segment, segment.block_ids)
        for num_blocks in self._initial_segment_blocks:
            self._add_segment(num_blocks)
        self.pool.reset()
        self._idle_since = None
        self._reset_counters()

    # -------------------------------------------------------------- reporting
    def stats(self) -> KVPoolStats:
        return KVPoolStats("elastic", self.pool.num_blocks, self.max_num_blocks,
                           len(self._segments), self.pool.layout.bytes_per_block,
                           self._num_grows,
                           self._num_shrinks, self._num_migrated_blocks,
                           self._num_evicted_blocks, self.arena.stats())

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants on ids (O(capacity); for tests)."""
        segment_ids = sorted(b for segment in self._segments for b in segment.block_ids)
        assert segment_ids == self.pool.online_block_ids(), "online ids != segment ids"
        for segment in self._segments:
            assert segment.handle.is_live
            assert segment.handle.offset == segment.first_block_id * self.kv_bytes_per_block
        self.pool.check_invariants()

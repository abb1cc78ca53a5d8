"""The block pool: the online KV blocks, their reference counts, and the free lists.

A block is `layout.block_size` token slots of KV cache; the pool hands out block *ids* and keeps
score of who holds them. The KV tensors are indexed by these ids elsewhere (`kv_cache`), so the
pool is pure Python and O(1) per block. Ids range over `0 .. capacity_blocks - 1`; id 0 is the
*null block* (`NULL_BLOCK_ID`): never online, never handed out. Block tables are padded with it
and its KV stays zero, so attention that reads past a sequence's blocks (padding, a masking
bug) reads zeros, never another request's KV. Every *online* block is in one of three states:

    free     ref_count == 0, no hash         on `_fresh_free_ids` (a LIFO stack)
    cached   ref_count == 0, hashed          on `_evictable_ids`  (LRU order, oldest first)
    used     ref_count  > 0 (hashed or not)  held by one or more block tables

A static pool has ids `1 .. num_blocks` online from the start; `ResizableBlockPool` brings ids
online and offline as an elastic pool's memory grows and shrinks.

Invariants (checked by `check_invariants`, exercised by the property tests):
- num_free + num_cached + num_used == num_blocks (the online count); no id on both free lists.
- An offline id (the null block included) is on no list, has ref_count 0, no hash and no filled
  slots; `allocate` never returns one.
- A block's ref_count equals the number of block tables holding it.
- A block is on `_evictable_ids` iff its ref_count is 0 and the prefix cache holds its hash.
- `_num_filled_slots_in_use` equals the filled slots summed over used blocks.
- num_allocations - num_frees == num_used (counters are reset only on an empty pool).
- Generations: every id carries a `generation` that changes exactly when the id stops naming
  the KV it held: handed out for new content (`allocate`, fresh or evicted from the prefix
  cache), and, in a resizable pool, relocated away or taken offline. A revival by a prefix hit
  and a `retain` keep it (the content is the same). So while an id's generation stays g, its
  KV is written only for the holder it was handed out to at g: a `(block_id, generation)` pair
  names one content, and a reader that finds the generation moved knows its pair is stale
  (`kvpool.memory.block_leases`). Generations never decrease (a reset keeps them); the null
  block's is 0 and a used block's at least 1.

Policy, and why: fresh blocks are reused LIFO (the most recently freed is the likeliest to sit
in a cache level close to the compute); cached blocks are evicted least-recently-used, and only
when no fresh block is left, so a prefix stays reusable for as long as memory allows;
`allocate(n)` is all-or-nothing, and `free`/`retain` validate every id before the pool keeps
any change, so a failed call never leaves it half-changed.

Listeners (`kvpool.memory.kv_listener`) hear the prefix cache through `listeners`, the pool's
fan-out (empty by default): every block published (`block_stored`), every cached block evicted
to make room for an allocation while its KV is still intact (`block_evicted`: the tiers spill
it; nothing writes a block between its eviction and the next step's copies), and every reset
(`pool_cleared`). Each event is one call, whoever listens. Events carry the pool's `medium`
("device" or "host"). A relocation keeps its hash and is not an event.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvpool.memory.errors import InvalidBlockError, OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_listener import KVListeners
from kvpool.memory.prefix_cache import BlockHash, NullPrefixCache, PrefixCache, PrefixMatch

NULL_BLOCK_ID = 0
DEVICE, HOST = "device", "host"  # a pool's medium: where its KV lives
RECENT_EVICTIONS = 4096  # evicted hashes the pool remembers, to tell "evicted" from "never seen"


@dataclass(frozen=True, slots=True)
class BlockPoolStats:
    """A snapshot of the pool; every count is in blocks unless its name says otherwise."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str  # the storage dtype's name ("int8", "float8_e4m3fn", "bfloat16", ...)
    bytes_per_block: int  # K/V codes and, for int8 / fp8, their scales
    num_free_blocks: int
    num_used_blocks: int
    num_cached_blocks: int
    usage: float  # used / total
    num_unfilled_slots: int  # reserved in used blocks but not yet holding a token
    num_allocations: int  # blocks that left free/cached (fresh, evicted, or cached and revived)
    num_frees: int  # blocks that came back; allocations - frees == used since the last reset
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    prefix_cache_queries_blocks: int
    prefix_cache_hits_blocks: int
    num_evictions: int


class BlockPool:
    """Reference-counted KV blocks with LIFO reuse and an LRU prefix cache."""

    def __init__(
        self,
        num_blocks: int,
        layout: KVLayout | None = None,
        enable_prefix_caching: bool = True,
        capacity_blocks: int | None = None,
        medium: str = DEVICE,
    ) -> None:
        """Ids `1 .. num_blocks` start online; `capacity_blocks` (default `num_blocks + 1`)
        sizes the id space, the null block included; `medium` names where the KV lives."""
        if capacity_blocks is None and num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        capacity_blocks = num_blocks + 1 if capacity_blocks is None else capacity_blocks
        if not 0 <= num_blocks < capacity_blocks:
            raise ValueError(f"need 0 <= num_blocks < capacity_blocks (one id is the null "
                             f"block), got {num_blocks} and {capacity_blocks}")
        self.layout = layout or KVLayout()
        self.medium = medium
        self.num_blocks = num_blocks  # online blocks
        self.capacity_blocks = capacity_blocks
        self.prefix_cache: PrefixCache = (
            PrefixCache() if enable_prefix_caching else NullPrefixCache()
        )
        self._ref_counts = [0] * capacity_blocks
        self._num_filled_slots = [0] * capacity_blocks
        self._is_online = [False] * capacity_blocks
        self._is_online[1 : num_blocks + 1] = [True] * num_blocks
        self._generations = [0] * capacity_blocks  # when they move: the module docstring
        # Reversed so that a new pool hands out 1, 2, 3, ... in order.
        self._fresh_free_ids: list[int] = list(range(num_blocks, 0, -1))
        self._evictable_ids: OrderedDict[int, None] = OrderedDict()
        self._num_filled_slots_in_use = 0
        self.listeners = KVListeners()  # registered at set-up (module docstring)
        # The pool's clock (the engine sets it to time.monotonic() before each step) and the
        # clock reading when each block last changed hands: allocated, revived or released.
        self.now = 0.0
        self._last_use = [math.nan] * capacity_blocks  # NaN: not used since the pool began
        self.recent_evictions: deque[BlockHash] = deque(maxlen=RECENT_EVICTIONS)
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero the allocation, eviction and prefix-cache counters (after an engine warm-up)."""
        self._num_allocations = 0
        self._num_frees = 0
        self._num_evictions = 0
        self._num_queries_blocks = 0
        self._num_hits_blocks = 0
        self._num_queries_tokens = 0
        self._num_hits_tokens = 0

    # ----------------------------------------------------------------- queries
    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks that never held a hashed prefix (or had theirs evicted)."""
        return len(self._fresh_free_ids)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a reusable prefix."""
        return len(self._evictable_ids)

    @property
    def num_allocatable_blocks(self) -> int:
        """How many blocks `allocate` can hand out right now (fresh plus evictable)."""
        return len(self._fresh_free_ids) + len(self._evictable_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_allocatable_blocks

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def is_shared(self, block_id: int) -> bool:
        """More than one block table holds this (valid) block."""
        return self._ref_counts[block_id] > 1

    def last_use(self, block_id: int) -> float:
        """The pool clock when this block last changed hands (NaN: not since the start)."""
        return self._last_use[block_id]

    def generation(self, block_id: int) -> int:
        """How many times this id has stopped naming its KV (module docstring); offline ids
        answer too, since a stale pair may name one."""
        if not (type(block_id) is int and 0 <= block_id < self.capacity_blocks):
            raise InvalidBlockError(f"block id {block_id!r} is outside the pool's capacity "
                                    f"({self.capacity_blocks})")
        return self._generations[block_id]

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable_ids

    def is_online(self, block_id: int) -> bool:
        return type(block_id) is int and 0 <= block_id < self.capacity_blocks and (
            self._is_online[block_id])

    def online_block_ids(self) -> list[int]:
        """Every online id, ascending (O(capacity_blocks))."""
        return [block_id for block_id, online in enumerate(self._is_online) if online]

    def free_block_ids(self) -> list[int]:
        """Fresh free ids in the order `allocate` would hand them out."""
        return self._fresh_free_ids[::-1]

    def evictable_block_ids(self) -> list[int]:
        """Cached unreferenced ids in eviction order (least recently used first)."""
        return list(self._evictable_ids)

    # ----------------------------------------------------------- allocate/free
    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks, each with ref_count 1; all or nothing."""
        if num_blocks == 1 and self._fresh_free_ids:  # the decode hot path
            block_id = self._fresh_free_ids.pop()
            self._ref_counts[block_id] = 1
            self._generations[block_id] += 1
            self._last_use[block_id] = self.now
            self._num_allocations += 1
            return [block_id]
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.num_allocatable_blocks:
            raise OutOfBlocksError(num_blocks, self.num_free_blocks, self.num_cached_blocks)
        block_ids = [self._take_one() for _ in range(num_blocks)]
        self._num_allocations += num_blocks
        return block_ids

    def _take_one(self, is_kv_intact: bool = True) -> int:
        """A fresh block, else the least recently used cached one, evicted (`is_kv_intact`:
        nothing overwrites its KV before the next step; False for a relocation target)."""
        if self._fresh_free_ids:
            block_id = self._fresh_free_ids.pop()
        else:
            block_id, _ = self._evictable_ids.popitem(last=False)
            entry = self.prefix_cache.remove(block_id)
            assert entry is not None, "an evictable block is hashed"
            self._num_evictions += 1
            self.recent_evictions.append(entry.block_hash)
            self.listeners.block_evicted(self.medium, block_id, entry, is_kv_intact)
        self._ref_counts[block_id] = 1
        self._generations[block_id] += 1
        self._num_filled_slots[block_id] = 0
        self._last_use[block_id] = self.now
        return block_id

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per id; a block whose count reaches zero returns to the pool.

        Pass a sequence's blocks tail first: cached blocks then join the LRU list tail first
        and are evicted before the prefix blocks other requests are likelier to reuse.
        All or nothing: on an id that holds no reference (unknown, offline, the null block, a
        non-int, a double free) every drop is undone, then InvalidBlockError is raised.
        """
        ref_counts = self._ref_counts
        if type(block_ids) is list and len(block_ids) == 1:  # the decode hot path
            block_id = block_ids[0]
            if type(block_id) is int and 0 < block_id < self.capacity_blocks and (
                    ref_counts[block_id]):
                ref_counts[block_id] -= 1
                if ref_counts[block_id] == 0:
                    self._release(block_id)
                return
        dropped: list[int] = []
        released: list[int] = []  # each id once: at the drop that reached zero
        try:
            for block_id in block_ids:
                self._check_referenced(block_id, "free")
                ref_counts[block_id] -= 1
                dropped.append(block_id)
                if ref_counts[block_id] == 0:
                    released.append(block_id)
        except InvalidBlockError:
            for block_id in dropped:
                ref_counts[block_id] += 1
            raise
        for block_id in released:
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        self._last_use[block_id] = self.now
        self._num_filled_slots_in_use -= self._num_filled_slots[block_id]
        self._num_frees += 1
        if block_id in self.prefix_cache.hashed_block_ids:
            self._evictable_ids[block_id] = None
        else:
            self._num_filled_slots[block_id] = 0
            self._fresh_free_ids.append(block_id)

    def retain(self, block_ids: Iterable[int]) -> None:
        """Add one reference per id: share used blocks, or revive cached ones; all or
        nothing (InvalidBlockError for an id that is neither used nor cached)."""
        block_ids = list(block_ids)
        for block_id in block_ids:
            self._check_id(block_id)
            if self._ref_counts[block_id] == 0 and block_id not in self._evictable_ids:
                raise InvalidBlockError(f"cannot retain block {block_id}: it is free")
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:  # a cached block leaves the pool again
                del self._evictable_ids[block_id]
                self._last_use[block_id] = self.now
                self._num_filled_slots_in_use += self._num_filled_slots[block_id]
                self._num_allocations += 1
            self._ref_counts[block_id] += 1

    def set_num_filled_slots(self, block_id: int, num_filled: int) -> None:
        """Record how many of a used block's slots hold tokens (for the waste statistic)."""
        assert self._ref_counts[block_id] > 0, "only used blocks are filled"
        assert 0 <= num_filled <= self.block_size
        self._num_filled_slots_in_use += num_filled - self._num_filled_slots[block_id]
        self._num_filled_slots[block_id] = num_filled

    def reset(self) -> None:
        """Make a pool with no used blocks look new: prefix cache emptied, free blocks handed
        out lowest id first again, counters zero (the engine calls it after its warm-up).
        Generations are kept: they never decrease."""
        if self.num_used_blocks:
            raise InvalidBlockError(f"cannot reset a pool with {self.num_used_blocks} used blocks")
        self.listeners.pool_cleared(self.medium)
        for block_id in self._evictable_ids:
            self.prefix_cache.remove(block_id)
            self._num_filled_slots[block_id] = 0
        self._evictable_ids.clear()
        self._fresh_free_ids = self.online_block_ids()[::-1]
        self._last_use = [math.nan] * self.capacity_blocks
        self.recent_evictions.clear()
        self.reset_counters()

    # ----------------------------------------------------------- prefix cache
    def match_prefix(
        self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int]
    ) -> PrefixMatch:
        """The longest run of cached blocks matching the leading full blocks of `token_ids`
        (whose chained hashes are `block_hashes`; extra hashes past its full blocks are
        ignored). Pure lookup: no references taken, no counters touched."""
        block_ids: list[int] = []
        size = self.block_size
        num_query_blocks = min(len(block_hashes), len(token_ids) // size)
        for index in range(num_query_blocks):
            block_id = self.prefix_cache.lookup(
                block_hashes[index], token_ids[index * size : (index + 1) * size]
            )
            if block_id is None:
                break
            block_ids.append(block_id)
        num_evictable = sum(1 for block_id in block_ids if block_id in self._evictable_ids)
        return PrefixMatch(block_ids, len(block_ids) * size, num_evictable, num_query_blocks,
                           len(token_ids))

    def num_blocks_to_admit(self, match: PrefixMatch, num_tokens: int) -> int:
        """Allocatable blocks a new table needs to hold `num_tokens` tokens, starting from
        `match`: its new blocks, plus the cached hits it revives (the admission arithmetic the
        engine and the simulator share)."""
        num_new_blocks = self.layout.num_blocks_for_tokens(num_tokens) - len(match.block_ids)
        return num_new_blocks + match.num_evictable

    def take_prefix(self, match: PrefixMatch) -> list[int]:
        """Take a reference on each block of `match` (found by `match_prefix` with nothing
        evicted since; a sliding-window group's match leads with null blocks, which are
        skipped) and count the query; returns the block ids."""
        live = [block_id for block_id in match.block_ids if block_id != NULL_BLOCK_ID]
        assert all(self.prefix_cache.is_cached(b) for b in live), "stale match"
        self.retain(live)
        self._num_queries_blocks += match.num_query_blocks
        self._num_queries_tokens += match.num_query_tokens
        self._num_hits_blocks += len(match.block_ids)
        self._num_hits_tokens += match.num_cached_tokens
        return list(match.block_ids)

    def publish(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int],
                parent_hash: BlockHash | None = None) -> bool:
        """Offer a full, computed, used block (chained on `parent_hash`, None for a first
        block or where unknown) to the prefix cache.

        Returns False when the cache keeps another block for this hash (two sequences computed
        the same prefix at once) or caching is off; the block then stays unhashed.
        """
        assert self._ref_counts[block_id] > 0, "only used blocks are published"
        assert len(token_ids) == self.block_size, "only full blocks are published"
        if not self.prefix_cache.insert(block_id, block_hash, token_ids):
            return False
        self.listeners.block_stored(self.medium, block_id, block_hash, parent_hash, token_ids)
        return True

    def unpublish(self, block_id: int) -> None:
        """Take a used block's hash back out of the prefix cache (the KV it was published for
        never arrived: a failed copy); listeners hear `block_removed`. No-op if unhashed."""
        self._check_referenced(block_id, "unpublish")
        entry = self.prefix_cache.remove(block_id)
        if entry is not None:
            self.listeners.block_removed(self.medium, block_id, entry.block_hash)

    # -------------------------------------------------------------- reporting
    def allocation_counters(self) -> tuple[int, int]:
        """(blocks allocated, blocks freed) since the last counter reset."""
        return self._num_allocations, self._num_frees

    def stats(self) -> BlockPoolStats:
        num_used = self.num_used_blocks
        return BlockPoolStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            kv_cache_dtype=self.layout.dtype,
            bytes_per_block=self.layout.bytes_per_block,
            num_free_blocks=self.num_free_blocks,
            num_used_blocks=num_used,
            num_cached_blocks=self.num_cached_blocks,
            usage=num_used / self.num_blocks if self.num_blocks else 0.0,
            num_unfilled_slots=num_used * self.block_size - self._num_filled_slots_in_use,
            num_allocations=self._num_allocations,
            num_frees=self._num_frees,
            prefix_cache_queries_tokens=self._num_queries_tokens,
            prefix_cache_hits_tokens=self._num_hits_tokens,
            prefix_cache_queries_blocks=self._num_queries_blocks,
            prefix_cache_hits_blocks=self._num_hits_blocks,
            num_evictions=self._num_evictions,
        )

    def check_invariants(self) -> None:
        """Assert every invariant in the module docstring (O(capacity_blocks); for tests)."""
        fresh = set(self._fresh_free_ids)
        evictable = set(self._evictable_ids)
        assert len(fresh) == len(self._fresh_free_ids), "duplicate id on the free stack"
        assert not fresh & evictable, "a block is both free and cached"
        assert sum(self._is_online) == self.num_blocks, "the online count is off"
        assert not self._is_online[NULL_BLOCK_ID], "the null block is online"
        assert self._generations[NULL_BLOCK_ID] == 0, "the null block was handed out"
        filled_in_use = 0
        for block_id, ref_count in enumerate(self._ref_counts):
            assert ref_count >= 0 and self._generations[block_id] >= 0
            is_hashed = self.prefix_cache.is_cached(block_id)
            if not self._is_online[block_id]:
                assert ref_count == 0 and not is_hashed, f"offline block {block_id} is in use"
                assert block_id not in fresh and block_id not in evictable
                assert self._num_filled_slots[block_id] == 0
            elif ref_count > 0:
                assert block_id not in fresh and block_id not in evictable
                assert self._generations[block_id] >= 1, f"used block {block_id} never handed out"
                filled_in_use += self._num_filled_slots[block_id]
            else:
                assert (block_id in evictable) == is_hashed
                assert (block_id in fresh) != is_hashed
        assert filled_in_use == self._num_filled_slots_in_use
        assert self._num_allocations - self._num_frees == self.num_used_blocks, "counters drift"

    def _check_id(self, block_id: int) -> None:
        """InvalidBlockError unless `block_id` is an online id (a plain int: bools, floats and
        numpy ints are refused, never read as ids)."""
        if not self.is_online(block_id):
            what = "is the null block" if block_id == NULL_BLOCK_ID and type(block_id) is int else (
                "does not exist")
            raise InvalidBlockError(
                f"block id {block_id!r} {what} (pool has {self.num_blocks} online of "
                f"{self.capacity_blocks})"
            )

    def _check_referenced(self, block_id: int, action: str) -> None:
        self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            why = "it holds no reference to drop (double free)" if action == "free" else (
                "it is not used")
            raise InvalidBlockError(f"cannot {action} block {block_id}: {why}")

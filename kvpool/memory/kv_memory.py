"""The engine's KV memory as one object: layout, arena, KV tensors, block pool and its sizing.

    KVMemory
      layout      KVLayout: block size, shape, dtype, bytes per block (the one owner)
      groups      one KV cache group of every layer (`HybridKVMemory` has several)
      arena       one reservation of (num_blocks + 1) blocks, the null block included
      kv_cache    KVCache over the arena: [num_blocks + 1, num_layers, 2, block_size, ...],
                  and for int8 / fp8 its scale pool beside it (same block ids)
      pool        BlockPool (static) or ResizableBlockPool (elastic) of block ids
      sizing      StaticKVPool (never resizes) or ElasticKVPool (segments grow and shrink)
      tiers       KVTiers: the host, disk and shared (Redis) tiers below the pool, an ordered
                  list, and the copies between them (`kvpool.memory.tiers`; with no tier,
                  nothing moves)
      listeners   the device side's listener fan-out (`kvpool.memory.kv_listener`): the
                  pool, its sizing, the tiers and the KV cache manager emit on it
      rates       PoolRates: the device pool's alloc/free rates, a listener on that fan-out

Everything above it (the KV cache manager, the engine, warm-up, the async engine's snapshots)
reaches KV memory through this object only: its queries (`max_num_blocks`, `can_ever_fit`),
growth on demand (`grow_until_allocatable`), the between-steps policy (`maybe_resize`),
`reset`, and statistics. `watermark_blocks` (the blocks admission leaves free for running
sequences) is derived here once, from the pool's largest size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence

import torch

from kvpool.memory.arena import Arena
from kvpool.memory.arena_free_list import align_up
from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool, BlockPoolStats
from kvpool.memory.block_table import BlockTable
from kvpool.memory.elastic_pool import ElasticKVPool, ElasticPoolConfig
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_groups import kv_groups
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_listener import KVListeners
from kvpool.memory.kv_pool import KVPool, KVPoolStats, StaticKVPool
from kvpool.memory.pool_rates import PoolRates
from kvpool.memory.prefix_cache import BlockHash, PrefixMatch
from kvpool.memory.resizable_block_pool import ResizableBlockPool
from kvpool.memory.tiers.disk_tier import DiskKVTier
from kvpool.memory.tiers.host_tier import HostKVTier
from kvpool.memory.tiers.kv_tiers import KVTiers, SwappedKV
from kvpool.memory.tiers.redis_tier import RedisKVTier
from kvpool.memory.tiers.tier_match import TierMatch


class KVMemory:
    """`num_blocks` usable KV blocks of `layout`, reserved at once on `device`."""

    def __init__(
        self,
        layout: KVLayout,
        num_blocks: int,
        device: torch.device | str = "cpu",
        *,
        enable_prefix_caching: bool = True,
        watermark: float = 0.0,
        elastic: ElasticPoolConfig | None = None,
        host_num_bytes: int = 0,
        disk: DiskKVTier | None = None,
        shared: RedisKVTier | None = None,
    ) -> None:
        """A static pool, or an elastic one when `elastic` is given; `watermark` is the
        fraction of the largest pool that admission keeps free (and, for an elastic pool, its
        low watermark: it grows when fewer blocks are allocatable). `host_num_bytes` of host
        memory make a host tier (page-locked on CUDA); `disk` is a disk tier, `shared` the shared
        tier (Redis)."""
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.layout = layout
        self.groups = kv_groups(layout, [None] * layout.num_layers)  # one: every layer, full
        self.watermark_blocks = int(watermark * num_blocks)
        bytes_per_block = layout.kv_bytes_per_block  # the arena holds codes; scales beside it
        num_rows = num_blocks + 1  # the null block first
        self.arena = Arena.reserve(align_up(num_rows * bytes_per_block, 256), device)
        if elastic is None:
            handle = self.arena.allocate(num_rows * bytes_per_block, alignment=bytes_per_block)
            storage = self.arena.buffer[handle.offset : handle.offset + handle.nbytes]
            self.kv_cache = KVCache(layout, num_rows, device, storage)
            self.pool: BlockPool = BlockPool(num_blocks, layout, enable_prefix_caching)
            self.sizing: KVPool = StaticKVPool(self.pool, self.kv_cache, self.arena)
        else:
            capacity_blocks = self.arena.num_reserved_bytes // bytes_per_block
            self.kv_cache = KVCache(layout, capacity_blocks, device, self.arena.buffer)
            self.pool = ResizableBlockPool(capacity_blocks, layout, enable_prefix_caching)
            elastic = dataclasses.replace(elastic, low_watermark_blocks=self.watermark_blocks)
            self.sizing = ElasticKVPool(self.pool, self.kv_cache, self.arena, elastic)
        host = HostKVTier.for_budget(layout, host_num_bytes,
                                     pin_memory=torch.device(device).type == "cuda")
        lower = [tier for tier in (host, disk, shared) if tier is not None]  # nearest first
        self.tiers = KVTiers(self.pool, self.kv_cache, lower)
        self.rates = PoolRates(self.pool)  # the device pool's alloc/free rates, for snapshots
        self.listeners.add(self.rates)

    # ----------------------------------------------------------------- queries
    @property
    def listeners(self) -> KVListeners:
        """The device pool's fan-out: register a listener here once to hear the device side
        (the host pool's own fan-out is `tiers.host.pool.listeners`)."""
        return self.pool.listeners

    @property
    def max_num_blocks(self) -> int:
        """Blocks the pool holds at its largest: what a single sequence can ever use."""
        return self.sizing.max_num_blocks

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether `num_tokens` tokens fit in the whole pool at its largest, alone."""
        return self.layout.num_blocks_for_tokens(num_tokens) <= self.max_num_blocks

    def max_concurrency(self, max_model_len: int) -> float:
        """Requests of `max_model_len` tokens the pool at its largest holds at once."""
        return self.layout.max_concurrency(self.max_num_blocks, max_model_len)

    # ------------------------------------------------- the KV cache manager's
    # (`HybridKVMemory` answers the same questions per KV cache group.)
    def new_block_table(self) -> BlockTable:
        return BlockTable(self.pool)

    def match_prefix(self, block_hashes: Sequence[BlockHash],
                     token_ids: Sequence[int]) -> PrefixMatch:
        return self.pool.match_prefix(block_hashes, token_ids)

    def blocks_to_admit(self, match: PrefixMatch, num_tokens: int) -> int:
        return self.pool.num_blocks_to_admit(match, num_tokens)

    @staticmethod
    def demand(table: BlockTable, num_new_tokens: int) -> int:
        return table.num_blocks_to_append(num_new_tokens)

    def has_free_blocks(self, num_blocks: int) -> bool:
        """Whether `num_blocks` fresh blocks are free now (no eviction, no growth)."""
        return num_blocks <= self.pool.num_free_blocks

    # ------------------------------------------------- the tiers, for the manager
    def reload(self, below: TierMatch, table: BlockTable, first_block: int) -> dict[str, int]:
        """Queue `below`'s copies into the table's blocks from `first_block` on (new blocks
        of a prefix found below the device); returns the blocks per source tier."""
        return self.tiers.reload(below, table.block_ids[first_block:])

    def swap_out(self, table: BlockTable) -> SwappedKV | None:
        """The table's blocks copied to host blocks (queued), or None: the host tier has no
        room (or there is none)."""
        host_ids = self.tiers.swap_out(table.block_ids)
        return None if host_ids is None else SwappedKV((host_ids,), (0,))

    def plan_swap_in(self, swapped: SwappedKV, block_hashes: Sequence[BlockHash],
                     token_ids: Sequence[int], num_tokens: int) -> tuple[PrefixMatch, int]:
        """The swapped sequence's leading blocks still cached on the device, `token_ids` its
        computed ones (retaken: no copy, no duplicate), and the blocks its first `num_tokens`
        tokens need beyond them."""
        prefix = self.match_prefix(block_hashes, token_ids)
        return prefix, self.blocks_to_admit(prefix, num_tokens)

    def swap_in(self, table: BlockTable, swapped: SwappedKV, prefix: PrefixMatch,
                num_computed: int) -> None:
        """`prefix` retaken, new blocks for the rest of the `num_computed` tokens with the host
        copies queued into them; the retaken blocks' host copies are freed."""
        [host_ids] = swapped.host_ids
        table.take_prefix(prefix)
        num_reused = len(prefix.block_ids)
        self.tiers.free_swapped(host_ids[:num_reused])
        table.append_slots(num_computed - prefix.num_cached_tokens)
        self.tiers.swap_in(host_ids[num_reused:], table.block_ids[num_reused:])

    def free_swapped(self, swapped: SwappedKV) -> None:
        """A swapped sequence ended without resuming: its host blocks go back."""
        self.tiers.free_swapped(swapped.host_ids[0])

    def before_step(self, written_block_ids: Callable[[], Collection[int]] = frozenset
                    ) -> None:
        """The tiers' queued copies, before the step's model (`KVTiers.before_step`)."""
        self.tiers.before_step(written_block_ids)

    # --------------------------------------------------------------- resizing
    def grow_until_allocatable(self, num_blocks: int, keep_watermark: bool = False) -> bool:
        """Grow (an elastic pool, a segment at a time) until `num_blocks` blocks (plus
        `watermark_blocks` with `keep_watermark`) are allocatable; False if the budget cannot
        give them (a static pool never grows)."""
        if keep_watermark:
            num_blocks += self.watermark_blocks
        while self.pool.num_allocatable_blocks < num_blocks:
            if not self.sizing.grow():
                return False
        return True

    def maybe_resize(self, now: float, block_tables: Iterable[BlockTable]) -> None:
        """The between-steps grow/shrink policy; `block_tables` must be every live table
        (read only if blocks have to move); `now` in seconds (time.monotonic)."""
        self.sizing.maybe_resize(now, block_tables)

    def reset(self) -> None:
        """With no block used: back to the start-up state, every counter zero (the disk tier
        keeps its files, Redis its values)."""
        self.tiers.reset()
        self.sizing.reset()

    # -------------------------------------------------------------- reporting
    def block_stats(self) -> BlockPoolStats:
        return self.pool.stats()

    def pool_stats(self) -> KVPoolStats:
        """Online blocks, segments, grows, shrinks, migrations, arena bytes."""
        return self.sizing.stats()

    def cache_pools(self) -> list[tuple[BlockPool, int]]:
        """Every pool with a prefix cache, and its KV cache group (0), device first."""
        host = self.tiers.host
        return [(self.pool, 0)] + ([] if host is None else [(host.pool, 0)])

    def set_clock(self, now: float) -> None:
        """The pools stamp blocks with this time as they change hands (their last-use age)."""
        self.pool.now = now
        for tier in self.tiers.tiers:
            if tier.pool is not None:
                tier.pool.now = now

    def check_invariants(self, swapped: Iterable[SwappedKV] = ()) -> None:
        """Assert every invariant of the pool, its sizing, its tensors and the tiers below
        (for tests); `swapped`: what the swapped-out sequences hold on the host."""
        self.tiers.check_invariants(sum(kv.num_blocks for kv in swapped))
        self.layout.check_tensor(self.kv_cache.tensor)
        self.layout.check_scales(self.kv_cache.scales, self.kv_cache.num_blocks)
        assert not self.kv_cache.tensor[NULL_BLOCK_ID].any(), "the null block was written"
        self.sizing.check_invariants()

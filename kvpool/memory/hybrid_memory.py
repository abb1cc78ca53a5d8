"""The engine's KV memory for a model whose layers form several KV cache groups.

    HybridKVMemory
      layout      the model's KVLayout (every layer): block size, dtype, bytes per token
      groups      KVGroup per attention kind and window (`kvpool.memory.kv_groups`)
      arena       the books of one reservation: the null page, then every group's pages,
                  carved on demand (the bytes themselves are the grouped cache's buffer)
      hybrid      HybridBlockPool: a block pool per group over that arena
      kv_cache    GroupedKVCache: each group's strided view of the arena, per-layer views
      pool        the first group's pool (the full-attention group's, if the model has one):
                  what block statistics, the snapshot, KV events and the recorder report
      tiers       GroupTiers: each group's host, disk and shared tiers, in its own layout
                  (`kvpool.memory.tiers.group_tiers`), sized by the caller

It answers the KV cache manager (`kvpool.engine.kv_manager`) with the same methods as
`KVMemory`, in per-group terms: a prefix match is a `GroupMatch`, a demand is a list of blocks
per group, and growing means taking pages from the arena (or from another group's spare ones).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

import torch

from kvpool.memory.arena import Arena
from kvpool.memory.arena_free_list import align_up
from kvpool.memory.block_pool import BlockPool, BlockPoolStats
from kvpool.memory.group_kv_cache import GroupedKVCache
from kvpool.memory.group_tables import GroupBlockTables
from kvpool.memory.hybrid_pool import HybridBlockPool
from kvpool.memory.hybrid_prefix import GroupMatch
from kvpool.memory.kv_groups import KVGroup, bytes_for_tokens, max_concurrency
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_listener import KVListeners
from kvpool.memory.kv_pool import KVPoolStats
from kvpool.memory.pool_rates import PoolRates
from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.tiers.group_tiers import GroupTierMatch, GroupTiers
from kvpool.memory.tiers.kv_tiers import SwappedKV
from kvpool.memory.tiers.lower_tier import LowerTier


@dataclass(frozen=True, slots=True)
class GroupDemand:
    """Blocks each group must be able to allocate, and the cached blocks of each that must
    stay (a planned prefix hit's)."""

    blocks: list[int]
    keep: tuple[frozenset[int], ...] = ()


class HybridKVMemory:
    """`num_bytes` of KV for `groups`, reserved at once on `device` (plus the null page)."""

    def __init__(self, layout: KVLayout, groups: Sequence[KVGroup], num_bytes: int,
                 device: torch.device | str = "cpu", *, enable_prefix_caching: bool = True,
                 watermark: float = 0.0,
                 lower: Sequence[Sequence[LowerTier]] | None = None) -> None:
        """`lower[g]`: group g's tiers below the device, nearest first (none by default)."""
        self.layout = layout
        self.groups = tuple(groups)
        null_bytes = max(group.page_bytes for group in self.groups)
        if num_bytes < sum(group.page_bytes for group in self.groups):
            raise ValueError(f"a KV budget of {num_bytes} bytes cannot hold one block of "
                             "every group")
        num_reserved = align_up(null_bytes + num_bytes, 256)
        # The arena keeps the books of the KV buffer's bytes over a meta tensor of its size:
        # the pools (which finished sequences' tables may keep alive until a collection)
        # never hold the KV itself; the grouped cache does.
        self.arena = Arena.reserve(num_reserved, "meta")
        self.hybrid = HybridBlockPool(self.groups, self.arena, enable_prefix_caching)
        buffer = torch.empty(num_reserved, dtype=torch.uint8, device=device)
        self.kv_cache = GroupedKVCache(self.groups, self.hybrid.unit, buffer)
        self.pool = self.hybrid.pools[0]
        self.num_usable_bytes = self.arena.num_reserved_bytes - self.hybrid.unit * (
            -(-null_bytes // self.hybrid.unit))
        self.watermark_blocks = int(watermark * self.max_num_blocks)
        self.tiers = GroupTiers(self.hybrid.pools, self.kv_cache.group_caches,
                                lower or [()] * len(self.groups))
        self.rates = PoolRates(self.pool)
        self.listeners.add(self.rates)

    # ----------------------------------------------------------------- queries
    @property
    def listeners(self) -> KVListeners:
        return self.pool.listeners

    @property
    def max_num_blocks(self) -> int:
        """Blocks of the first group the reservation holds if that group has it all."""
        return self.num_usable_bytes // self.hybrid.page_bytes[0]

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether one sequence of `num_tokens` tokens fits alone even computed in one step
        (a preempted one is recomputed as a prompt), when every group holds all its blocks:
        a sequence never outgrows what a re-admission needs."""
        return bytes_for_tokens(self.groups, num_tokens, num_tokens) <= self.num_usable_bytes

    def max_concurrency(self, max_model_len: int) -> float:
        return max_concurrency(self.groups, self.num_usable_bytes, max_model_len)

    # ------------------------------------------------- the KV cache manager's
    def new_block_table(self) -> GroupBlockTables:
        return GroupBlockTables(self.hybrid)

    def match_prefix(self, block_hashes: Sequence[BlockHash],
                     token_ids: Sequence[int]) -> GroupMatch:
        return self.hybrid.match_prefix(block_hashes, token_ids)

    def blocks_to_admit(self, match: GroupMatch, num_tokens: int) -> GroupDemand:
        """Blocks per group a new sequence needs from `match`, whose cached blocks must stay
        until it takes them (no other group may take their pages back meanwhile)."""
        return GroupDemand(self.hybrid.num_blocks_to_admit(match, num_tokens),
                           tuple(frozenset(m.block_ids) for m in match.matches))

    @staticmethod
    def demand(table: GroupBlockTables, num_new_tokens: int) -> GroupDemand:
        return GroupDemand(table.group_demands(num_new_tokens))

    def grow_until_allocatable(self, demand: GroupDemand, keep_watermark: bool = False) -> bool:
        """Pages for `demand` (with `keep_watermark`, the first group's watermark on top)."""
        blocks = list(demand.blocks)
        if keep_watermark:
            blocks[0] += self.watermark_blocks
        return self.hybrid.make_allocatable(blocks, demand.keep)

    def has_free_blocks(self, demand: GroupDemand) -> bool:
        """Whether `demand` fits without evicting a cached block or taking another group's
        pages (speculative drafts' rule): free blocks, and pages the arena still has."""
        return self.hybrid.make_free(demand.blocks)

    # ------------------------------------------------- the tiers, for the manager
    def reload(self, below: GroupTierMatch, table: GroupBlockTables,
               first_block: int) -> dict[str, int]:
        """`KVMemory.reload`, each group into its own new blocks."""
        return self.tiers.reload(below, [ids[first_block:] for ids in table.group_block_ids])

    def swap_out(self, table: GroupBlockTables) -> SwappedKV | None:
        """Every group's live blocks copied to its host tier (queued), or None."""
        return self.tiers.swap_out([t.live_block_ids for t in table.tables],
                                   [t.num_dropped_blocks for t in table.tables])

    def plan_swap_in(self, swapped: SwappedKV, block_hashes: Sequence[BlockHash],
                     token_ids: Sequence[int], num_tokens: int) -> tuple[GroupMatch, GroupDemand]:
        """No device prefix is retaken (each group's would have to line up with its swapped
        blocks and dropped ones): every group needs its blocks for `num_tokens` tokens, but
        for those its window had dropped."""
        num_blocks = self.layout.num_blocks_for_tokens(num_tokens)
        demand = GroupDemand([num_blocks - dropped for dropped in swapped.num_dropped])
        return self.hybrid.match_prefix((), ()), demand

    def swap_in(self, table: GroupBlockTables, swapped: SwappedKV, prefix: GroupMatch,
                num_computed: int) -> None:
        """Every group's table restored in new blocks, the host copies queued into them."""
        table.restore(num_computed, swapped.num_dropped)
        self.tiers.swap_in(swapped, [t.block_ids[dropped:] for t, dropped
                                     in zip(table.tables, swapped.num_dropped, strict=True)])

    def free_swapped(self, swapped: SwappedKV) -> None:
        self.tiers.free_swapped(swapped)

    def before_step(self, written_block_ids: Callable[[], Collection[int]] = frozenset
                    ) -> None:
        """The tiers' copies, before the step's model: every group's copy-outs first, then
        the pages carved since the last step cleared (they may hold another group's bytes,
        which the copy-outs had to read first: `GroupedKVCache.clear_pages`), then the
        copies in."""
        self.tiers.run_copy_outs()
        self.kv_cache.clear_pages(self.hybrid.take_fresh_pages())
        self.tiers.before_step(written_block_ids)

    # --------------------------------------------------------------- resizing
    def maybe_resize(self, now: float, block_tables: Iterable[object]) -> None:
        """Pages move between groups on demand; nothing to do between steps."""

    def reset(self) -> None:
        self.tiers.reset()
        for pool in self.hybrid.pools:
            pool.reset()

    # -------------------------------------------------------------- reporting
    def block_stats(self) -> BlockPoolStats:
        """The first group's pool statistics (its prefix-cache and allocation counters), with
        the block counts over every group in the first group's pages: bytes / its page size,
        so used + cached + free = the reservation, and `usage` is the bytes' fraction."""
        page, hybrid = self.hybrid.page_bytes[0], self.hybrid
        pairs = list(zip(hybrid.pools, hybrid.page_bytes, strict=True))
        used = sum(pool.num_used_blocks * size for pool, size in pairs) // page
        cached = sum(pool.num_cached_blocks * size for pool, size in pairs) // page
        total = self.max_num_blocks
        return dataclasses.replace(self.pool.stats(), num_blocks=total, num_used_blocks=used,
                                   num_cached_blocks=cached,
                                   num_free_blocks=total - used - cached,
                                   usage=hybrid.num_used_bytes() / self.num_usable_bytes)

    def pool_stats(self) -> KVPoolStats:
        page = self.hybrid.page_bytes[0]
        online = sum(pool.num_blocks * bytes_ for pool, bytes_ in
                     zip(self.hybrid.pools, self.hybrid.page_bytes, strict=True)) // page
        return KVPoolStats("hybrid", online, self.max_num_blocks, 1, page, 0, 0, 0, 0,
                           self.arena.stats())

    def cache_pools(self) -> list[tuple[BlockPool, int]]:
        """Every pool with a prefix cache and its KV cache group: each group's device pool,
        then each group's host pool."""
        hosts = [(tiers.host.pool, group) for group, tiers in enumerate(self.tiers.groups)
                 if tiers.host is not None]
        return [(pool, group) for group, pool in enumerate(self.hybrid.pools)] + hosts

    def set_clock(self, now: float) -> None:
        """Every group's pools, and their tiers', stamp blocks with this time."""
        for pool in (*self.hybrid.pools, *self.tiers.pools()):
            pool.now = now

    def check_invariants(self, swapped: Iterable[SwappedKV] = ()) -> None:
        self.tiers.check_invariants(swapped)
        self.hybrid.check_invariants()
        self.kv_cache.check_null_page()

"""One KV reservation shared by every KV cache group, each group's blocks a page of its own size.

Groups (`kvpool.memory.kv_groups`) need blocks of different sizes: Gemma 3 1B's full group
holds 4 layers a block, its sliding group 22; Gemma 4's sliding and global layers differ in
head size; a draft model's or a quantized group's pages differ again. Padding every page to the
largest wastes the difference; splitting the budget between groups up front strands memory in
whichever group the workload needs less (short prompts fill a sliding group as fast as a full
one). So the groups share one arena (`kvpool.memory.arena`) and take pages of their own size
from it on demand:

    unit      = gcd of the groups' page bytes (Gemma 3 1B, bf16, 16 tokens: 16 KiB, one layer)
    block id  = page offset / unit   (each group's ids index its own strided view of the buffer:
                                      `[num_units, L_g, 2, block_size, H, D]`, dim 0's stride
                                      one unit, so page b of group g is bytes
                                      b * unit .. b * unit + page_g)
    null      = the first max-page bytes, taken at reservation: id 0 in every group

Each group keeps a `ResizableBlockPool` of the ids it holds pages for, with its own free list,
reference counts and prefix cache. `make_allocatable` brings pages online for the blocks a step
or an admission needs: fresh pages from the arena first, and when the arena has no room, the
other groups' spare pages (free ones first, then cached ones, least recently used first) go
back to it. A page stays with its group while free, so a sliding window's steady turnover
(one block dropped, one taken, every `block_size` tokens) never touches the arena. Pages of
mixed sizes fragment the arena: when no gap holds a page though the free bytes would, every
unused page goes back (`_flush`, cached prefixes evicted) and the pages are taken again; used
pages never move (no relocation yet), so this only guarantees progress once they are freed.

Invariants (`check_invariants`): every group pool's own; each online id has exactly one live
arena handle, at offset id * unit, of its group's page bytes, and the arena holds nothing else
but the null page; bytes are the arena's (live + free tile the reservation).

Generations (`BlockPool.generation`) live in each group's pool: a page given back to the arena
goes offline in its group, which advances its generation there, and the group that carves
those bytes next hands its own id out with its own advance, so no `(group, block id,
generation)` outlives the bytes it named.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

from kvpool.memory.arena import Arena, ArenaHandle, ArenaOutOfMemoryError
from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.hybrid_prefix import GroupMatch, match_groups
from kvpool.memory.kv_groups import KVGroup, page_rows
from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.resizable_block_pool import ResizableBlockPool


class HybridBlockPool:
    """The blocks of every group of `groups`, carved from `arena` on demand."""

    def __init__(self, groups: Sequence[KVGroup], arena: Arena,
                 enable_prefix_caching: bool = True) -> None:
        if not groups:
            raise ValueError("a KV pool needs at least one group")
        self.groups = tuple(groups)
        self.arena = arena
        self.page_bytes = tuple(group.page_bytes for group in self.groups)
        self.unit = math.gcd(*self.page_bytes)
        null = arena.allocate(max(self.page_bytes), alignment=self.unit)
        if null.offset != 0:
            raise ValueError("the arena must be empty: the null page goes first")
        self.num_units = arena.num_reserved_bytes // self.unit
        self.pools = tuple(ResizableBlockPool(self.num_units, group.layout, enable_prefix_caching)
                           for group in self.groups)
        self._handles: tuple[dict[int, ArenaHandle], ...] = tuple({} for _ in self.groups)
        self._fresh: list[tuple[int, int]] = []  # (group, id) carved since `take_fresh_pages`

    # ----------------------------------------------------------------- queries
    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    def num_rows(self, group: int) -> int:
        """Rows of group `group`'s strided view: the ids whose page fits in the buffer."""
        return page_rows(self.arena.num_reserved_bytes, self.page_bytes[group], self.unit)

    def match_prefix(self, block_hashes: Sequence[BlockHash],
                     token_ids: Sequence[int]) -> GroupMatch:
        """The longest cached prefix every group serves (`kvpool.memory.hybrid_prefix`)."""
        return match_groups(self.groups, self.pools, block_hashes, token_ids)

    def num_blocks_to_admit(self, match: GroupMatch, num_tokens: int) -> list[int]:
        """Allocatable blocks per group a new sequence of `num_tokens` tokens needs from
        `match` (`BlockPool.num_blocks_to_admit`, group by group)."""
        return [pool.num_blocks_to_admit(group_match, num_tokens)
                for pool, group_match in zip(self.pools, match.matches, strict=True)]

    def num_used_bytes(self) -> int:
        """Bytes of the pages some table holds, over every group."""
        pairs = zip(self.pools, self.page_bytes, strict=True)
        return sum(pool.num_used_blocks * page for pool, page in pairs)

    # ------------------------------------------------------------------ growth
    def make_allocatable(self, demands: Sequence[int],
                         keep: Sequence[Collection[int]] = ()) -> bool:
        """Bring pages online until group g can allocate `demands[g]` blocks at once, for
        every g, never taking back the cached blocks of `keep[g]` (a planned prefix hit's);
        False if the reservation cannot hold them all (then nothing is allocated, though
        pages may have moved between groups, free)."""
        keep = tuple(keep) or tuple(() for _ in self.groups)
        if self._take_pages(demands, keep):
            return True
        self._flush(keep)  # fragmented: every unused page back, then once more
        return self._take_pages(demands, keep)

    def _take_pages(self, demands: Sequence[int], keep: Sequence[Collection[int]]) -> bool:
        for group, need in enumerate(demands):
            missing = need - self.pools[group].num_allocatable_blocks
            while missing > 0:
                taken = self._grow(group, missing)
                if not taken and not self._reclaim(group, demands, keep):
                    return False
                missing -= taken
        return True

    def _flush(self, keep: Sequence[Collection[int]]) -> None:
        """Give the arena back every page no table holds (the cached ones evicted) but those
        of `keep`: pages of mixed sizes left free among used ones can leave no gap a large
        page fits, while the free bytes would hold it. With no page used, the arena is whole
        again, so a sequence that fits the reservation alone is always admitted."""
        for group, pool in enumerate(self.pools):
            unused = pool.free_block_ids() + [block_id for block_id in pool.evictable_block_ids()
                                              if block_id not in keep[group]]
            if unused:
                self._release(group, unused)

    def make_free(self, demands: Sequence[int]) -> bool:
        """Like `make_allocatable`, from free blocks and the arena's free bytes only: no
        cached block is evicted and no group gives up a page (speculative drafts' rule)."""
        for group, need in enumerate(demands):
            missing = need - self.pools[group].num_free_blocks
            if missing > 0 and self._grow(group, missing) < missing:
                return False
        return True

    def _grow(self, group: int, count: int) -> int:
        """Up to `count` fresh pages from the arena for `group`; how many it got."""
        page, handles, new_ids = self.page_bytes[group], self._handles[group], []
        for _ in range(count):
            try:
                handle = self.arena.allocate(page, alignment=self.unit)
            except ArenaOutOfMemoryError:
                break
            block_id = handle.offset // self.unit
            handles[block_id] = handle
            new_ids.append(block_id)
        if new_ids:
            self.pools[group].add_blocks(new_ids)
            self._fresh.extend((group, block_id) for block_id in new_ids)
        return len(new_ids)

    def take_fresh_pages(self) -> list[tuple[int, int]]:
        """The (group, id) pages carved from the arena since the last call: their bytes may
        still be another group's (`GroupedKVCache.clear_pages`)."""
        fresh, self._fresh = self._fresh, []
        return fresh

    def _reclaim(self, group: int, demands: Sequence[int],
                 keep: Sequence[Collection[int]]) -> bool:
        """Give the arena back another group's spare pages: every free one, else the least
        recently used cached one not in `keep`; False if no group has a spare page."""
        spares = {other: self.pools[other].num_allocatable_blocks - demands[other]
                  for other in range(self.num_groups) if other != group}
        for other, spare in spares.items():
            free = self.pools[other].free_block_ids()[:max(spare, 0)]
            if free:
                self._release(other, free)
                return True
        candidates = []
        for other, spare in spares.items():
            oldest = next((block_id for block_id in self.pools[other].evictable_block_ids()
                           if block_id not in keep[other]), None) if spare > 0 else None
            if oldest is not None:
                candidates.append((self.pools[other].last_use(oldest), other, oldest))
        if not candidates:
            return False
        _, other, block_id = min(candidates)
        self._release(other, [block_id])
        return True

    def _release(self, group: int, block_ids: list[int]) -> None:
        """Take unused pages offline (evicting cached ones, whose KV a tier below may still
        copy before the step writes the page) and return their bytes."""
        self.pools[group].remove_blocks(block_ids, is_kv_intact=True)
        for block_id in block_ids:
            self.arena.free(self._handles[group].pop(block_id))

    # -------------------------------------------------------------- reporting
    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (O(units); for tests)."""
        self.arena.check_invariants()
        live = {handle.offset: handle for handle in self.arena.live_handles()}
        assert live.pop(0).nbytes == max(self.page_bytes), "the null page is missing"
        for group, (pool, handles) in enumerate(zip(self.pools, self._handles, strict=True)):
            pool.check_invariants()
            assert sorted(handles) == pool.online_block_ids(), f"group {group}: ids != pages"
            for block_id, handle in handles.items():
                assert live.pop(block_id * self.unit) is handle, f"page {block_id} is not live"
                assert handle.nbytes == self.page_bytes[group]
                assert block_id != NULL_BLOCK_ID and block_id < self.num_rows(group)
        assert not live, f"arena ranges no group owns: {sorted(live)}"

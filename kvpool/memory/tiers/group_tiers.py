"""The tiers below a hybrid pool: one `KVTiers` per KV cache group, moved as one.

A hybrid pool's groups (`kvpool.memory.kv_groups`) keep blocks of their own layers, pages of
their own size, under the same chained block hashes. Below the device each group has tiers of
its own, in its own layout: a host tier (its share of `swap_space`), a disk namespace and a
Redis namespace that name the group's layers, so a group's block is found only by that group.
Each group's `KVTiers` hears its group's pool, so spills and write-through need nothing more.
This class answers the KV memory's questions in per-group terms:

- Reload: the device's hybrid match ends at block j (`kvpool.memory.hybrid_prefix`). Every
  group then looks below from j on; the prefix grows by the blocks *every* group finds there
  (a full group needs them all; a sliding group's live ones are among them, so vLLM's rule
  holds, if a little strictly: a sliding group's spilled block it would not read still counts).
- Swap: a preempted sequence's live blocks of every group go to that group's host tier, all
  or none (`SwappedKV`); a sliding group's dropped ones stay dropped.
- The step: the groups share device bytes, a page one group gave up may be another's this
  step, so every group's copy-outs run before any group's copy-ins, on one side stream.

Events, the snapshot and the statistics read the first group's tiers (`tiers`, `host`, ...),
as the block statistics read the first group's pool.

Invariants (`check_invariants`): every group's `KVTiers`' own, each against the host blocks
the swapped sequences hold in that group.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.group_kv_cache import GroupKV
from kvpool.memory.kv_listener import KVListener
from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.tiers.disk_tier import DiskKVTier
from kvpool.memory.tiers.host_tier import HostKVTier
from kvpool.memory.tiers.kv_tiers import KVTiers, KVTierStats, SwappedKV
from kvpool.memory.tiers.lower_tier import LowerTier
from kvpool.memory.tiers.side_stream import SideStream
from kvpool.memory.tiers.tier_match import TierMatch


@dataclass(frozen=True, slots=True)
class GroupTierMatch:
    """One `TierMatch` per group, all of `num_blocks` blocks."""

    matches: tuple[TierMatch, ...]

    @property
    def num_blocks(self) -> int:
        return self.matches[0].num_blocks

    @classmethod
    def common(cls, matches: Sequence[TierMatch]) -> GroupTierMatch:
        """The matches, cut (in place) to the blocks every group has."""
        num_blocks = min(match.num_blocks for match in matches)
        for match in matches:
            del match.sources[num_blocks:]
        return cls(tuple(matches))


class GroupTiers(KVListener):
    """`KVTiers` for each group's pool, cache view and tiers (`lower[g]`, nearest first)."""

    def __init__(self, pools: Sequence[BlockPool], caches: Sequence[GroupKV],
                 lower: Sequence[Sequence[LowerTier]]) -> None:
        side = SideStream.for_device(caches[0].tensor.device)
        self.groups = tuple(KVTiers(pool, cache, tiers, side)
                            for pool, cache, tiers in zip(pools, caches, lower, strict=True))
        # Every id of each group's view: what a step may write, as far as copies know.
        self._every_id = tuple((lambda rows=cache.tensor.shape[0]: range(rows))
                               for cache in caches)
        self._first_pool = pools[0]
        if len(self.groups) > 1 and any(lower):  # the step's end, heard on the first pool
            pools[0].listeners.add(self, reacts=True)

    # The first group's tiers: what events, the snapshot and the statistics read.
    @property
    def tiers(self) -> list[LowerTier]:
        return self.groups[0].tiers

    @property
    def host(self) -> HostKVTier | None:
        return self.groups[0].host

    @property
    def disk(self) -> DiskKVTier | None:
        return self.groups[0].disk

    @property
    def shared(self) -> LowerTier | None:
        return self.groups[0].shared

    @property
    def has_host(self) -> bool:
        return self.groups[0].has_host

    def pools(self) -> Iterable[BlockPool]:
        """Every group's lower-tier block pools (their clocks are stamped each step)."""
        return (tier.pool for tiers in self.groups for tier in tiers.tiers
                if tier.pool is not None)

    # ---------------------------------------------------------------- reload
    def find_below(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
                   first_block: int, num_blocks: int) -> GroupTierMatch:
        return GroupTierMatch.common([tiers.find_below(block_hashes, token_ids, first_block,
                                                       num_blocks) for tiers in self.groups])

    def validate(self, match: GroupTierMatch, token_ids: Sequence[int],
                 first_block: int) -> None:
        """Read and check every group's stored blocks; the match ends where one group's
        does."""
        for tiers, group_match in zip(self.groups, match.matches, strict=True):
            tiers.validate(group_match, token_ids, first_block)
        GroupTierMatch.common(match.matches)

    def hold(self, match: GroupTierMatch) -> None:
        for tiers, group_match in zip(self.groups, match.matches, strict=True):
            tiers.hold(group_match)

    def reload(self, match: GroupTierMatch,
               device_ids: Sequence[Sequence[int]]) -> dict[str, int]:
        """Queue every group's copies into its new blocks; returns the first group's blocks
        per source tier (the prefix's, as every group reloads the same blocks)."""
        counts = [tiers.reload(group_match, ids) for tiers, group_match, ids
                  in zip(self.groups, match.matches, device_ids, strict=True)]
        return counts[0]

    # ------------------------------------------------------------------ swap
    def swap_out(self, live_ids: Sequence[Sequence[int]],
                 num_dropped: Sequence[int]) -> SwappedKV | None:
        """Every group's live blocks copied to its host tier, or None (nothing taken) if one
        has no room."""
        for tiers, ids in zip(self.groups, live_ids, strict=True):
            if tiers.host is None or tiers.host.pool.num_allocatable_blocks < len(ids):
                return None
        pairs = zip(self.groups, live_ids, strict=True)
        host_ids = tuple(tiers.swap_out(ids) for tiers, ids in pairs)
        return SwappedKV(host_ids, tuple(num_dropped))

    def swap_in(self, swapped: SwappedKV, device_ids: Sequence[Sequence[int]]) -> None:
        for tiers, host_ids, ids in zip(self.groups, swapped.host_ids, device_ids, strict=True):
            tiers.swap_in(host_ids, ids)

    def free_swapped(self, swapped: SwappedKV) -> None:
        for tiers, host_ids in zip(self.groups, swapped.host_ids, strict=True):
            tiers.free_swapped(host_ids)

    # ------------------------------------------------------------- the step
    def run_copy_outs(self) -> None:
        """Every group's queued device → host copies, now (module docstring). On CUDA the
        step waits for them all: ids of different groups overlap in bytes, so the step's
        written ids cannot tell which copies it would clobber."""
        for tiers, every_id in zip(self.groups, self._every_id, strict=True):
            tiers.transfers.run_copy_outs(every_id)

    def before_step(self, written_block_ids: Callable[[], Collection[int]] = frozenset) -> None:
        """Every group's copy-outs, then the rest (`written_block_ids` unused: see
        `run_copy_outs`)."""
        self.run_copy_outs()
        for tiers, every_id in zip(self.groups, self._every_id, strict=True):
            tiers.before_step(every_id)

    def step_ended(self, next_step: int) -> None:
        for tiers in self.groups[1:]:  # the first hears its own pool
            tiers.step_ended(next_step)

    def step_rolled_back(self) -> None:
        for tiers in self.groups[1:]:
            tiers.step_rolled_back()

    def close(self) -> None:
        for tiers in self.groups:
            tiers.close()
        if self in self._first_pool.listeners:
            self._first_pool.listeners.remove(self)

    def reset(self) -> None:
        for tiers in self.groups:
            tiers.reset()

    # -------------------------------------------------------------- reporting
    def stats(self) -> KVTierStats:
        return self.groups[0].stats()

    def check_invariants(self, swapped: Iterable[SwappedKV] = ()) -> None:
        swapped = list(swapped)
        for group, tiers in enumerate(self.groups):
            tiers.check_invariants(sum(len(kv.host_ids[group]) for kv in swapped))

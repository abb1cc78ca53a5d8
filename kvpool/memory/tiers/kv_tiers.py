"""The KV tiers below the device pool: the host tier, the disk tier, the shared tier (Redis),
and what moves between them.

    device pool ──evict──▶ host tier ──evict──▶ disk tier        (spill: cached prefix blocks)
        ▲   │                  │                    ▲
        │   ├──publish─────────┼──write-through─────┘            (full blocks, after the step)
        │   └──publish─────────┼──write-through─────▶ shared tier (Redis: every replica's)
        └──────reload──────────┴── from host, disk or shared     (a prefix hit below the device)
    device pool ◀──swap-in── host tier ◀──swap-out── device      (a preempted sequence's blocks)

- Spill: a cached block the device evicts (`block_evicted`: the tiers are a `KVListener` on
  the device pool, registered once, as reacting) is copied to a host
  block that joins the host's prefix cache under the same hash; a block the host evicts in turn
  goes to disk unless the disk already has it.
- Write-through: every block the device publishes is written to disk and to the shared tier
  after the step that computed it (`after_step`: one host snapshot of the blocks either lacks,
  handed to each tier's writer thread), so a restart or another replica finds it; a block the
  shared tier knows to be in Redis (reloaded from there, say) is not written back. At a clean
  shutdown (`close`) spilled host blocks the disk lacks follow. A step that fails
  (`step_rolled_back`) writes nothing, and a queued block is written only while the device's
  prefix cache still maps it to the hash it was queued under: a block freed and taken by
  another request meanwhile holds that request's KV, which must never go out under the hash.
- Reload: a prefix lookup that ends on the device walks on (`find_below`): host, then disk,
  then shared, block by block, while the hash chain matches (`kvpool.memory.tiers.tier_match`); disk
  and shared blocks are read and validated (`validate`) once the admission is known to fit;
  then `reload` queues the copies into new device blocks.
- Swap: `swap_out` copies a sequence's blocks to host blocks it owns; `swap_in` copies them
  back into new device blocks and frees them.

An elastic device pool's resize waits for the copies in flight (`pool_resizing`:
`KVTransfers.wait_all`) before it relocates or zeroes blocks.

Every key is the salted chained hash (`kvpool.memory.prefix_cache`), so a tenant's blocks are
found only under its own salt, in every tier. Copies are queued (`kvpool.memory.tiers.kv_transfer`)
and run by `before_step`, before the step's model.

The tiers are one ordered list, nearest first (`tiers`: host, disk, shared, each optional),
behind one interface (`kvpool.memory.tiers.lower_tier.LowerTier`): the lookup, the
write-through, `stats`, `close` and `check_invariants` are each one loop over it. The host
tier is also named (`host`): swaps and spills copy into its block pool.

Invariants (`check_invariants`): every tier's own; the host blocks held for copies are exactly
those the transfer queue will release.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from functools import partial

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.group_kv_cache import GroupKV
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_listener import KVListener
from kvpool.memory.prefix_cache import BlockHash, CachedBlock
from kvpool.memory.tiers.disk_tier import DiskKVTier, DiskTierStats
from kvpool.memory.tiers.host_tier import HostKVTier, HostTierStats
from kvpool.memory.tiers.kv_transfer import KVTransfers
from kvpool.memory.tiers.lower_tier import DISK, HOST, SHARED, LowerTier
from kvpool.memory.tiers.redis_tier import SharedTierStats
from kvpool.memory.tiers.side_stream import SideStream
from kvpool.memory.tiers.tier_match import LoadedBlock, TierLookup, TierMatch

TIERS = ("device", HOST, DISK, SHARED)  # everywhere: counters, metrics' source label


@dataclass(frozen=True, slots=True)
class KVTierStats:
    """Counters over the tiers' life (since the engine's last reset), and their snapshots
    (swap preemption's counters are the KV manager's: `EngineStats`)."""

    host: HostTierStats | None
    disk: DiskTierStats | None
    shared: SharedTierStats | None
    num_spilled_blocks: int  # device evictions copied to the host tier
    num_dropped_spills: int  # device evictions the host had no room for
    num_reloaded_blocks: dict[str, int]  # prefix blocks copied up, by source tier
    bytes_per_block: int


@dataclass(frozen=True, slots=True)
class SwappedKV:
    """A swapped-out sequence's KV on the host, per KV cache group: the host blocks holding
    its table's live blocks in order, after the `num_dropped` leading ones its sliding window
    had already dropped (no query reads them again: nothing to copy; 0 for full attention)."""

    host_ids: tuple[list[int], ...]
    num_dropped: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        """Host blocks held, over every group (a hybrid pool's hold their group's layers)."""
        return sum(len(host_ids) for host_ids in self.host_ids)


class KVTiers(KVListener):
    """Spill, write-through, reload and swap between a device pool and the tiers below it,
    `tiers`: an ordered list, nearest first, of at most one tier per name (`LowerTier`)."""

    def __init__(self, device_pool: BlockPool, device_cache: KVCache | GroupKV,
                 tiers: Sequence[LowerTier] = (), side_stream: SideStream | None = None) -> None:
        """`side_stream`: the copies' stream (default: a new one on CUDA; `GroupTiers`
        shares one between its groups, so copies keep their order across them)."""
        names = [tier.name for tier in tiers]
        assert len(set(names)) == len(names), f"one tier per name, got {names}"
        self.device_pool = device_pool
        self.tiers = list(tiers)
        self._by_name = {tier.name: tier for tier in self.tiers}
        host = self.host
        self._lookup = TierLookup(device_pool.block_size, self.tiers)
        self.bytes_per_block = device_pool.layout.bytes_per_block
        # The callback holds the pools, not this object: a cycle through it would keep the
        # device KV alive after the engine is dropped, until a full collection.
        self.transfers = KVTransfers(device_cache, host.kv_cache if host else None,
                                     host.pool.free if host else _nothing_to_release,
                                     side_stream,
                                     on_unfilled=partial(_unpublish, device_pool,
                                                         host.pool if host else None))
        self._to_write: list[tuple[int, BlockHash, tuple[int, ...]]] = []
        if self.tiers:
            device_pool.listeners.add(self, reacts=True)
        disk = self.disk
        if host is not None and disk is not None:
            host.pool.listeners.add(_HostToDisk(host, disk), reacts=True)
        self.reset_counters()

    # The tiers by name (None: not configured); the host tier is the one swaps and spills use.
    @property
    def host(self) -> HostKVTier | None:
        return self._by_name.get(HOST)

    @property
    def disk(self) -> DiskKVTier | None:
        return self._by_name.get(DISK)

    @property
    def shared(self) -> LowerTier | None:
        return self._by_name.get(SHARED)

    @property
    def has_host(self) -> bool:
        return HOST in self._by_name

    def reset_counters(self) -> None:
        self._num_spilled = 0
        self._num_dropped_spills = 0
        self._num_reloaded = dict.fromkeys(TIERS[1:], 0)
        self._is_written_through = any(tier.name != HOST for tier in self.tiers)

    # --------------------------------------------------- device pool listener
    def block_stored(self, medium: str, block_id: int, block_hash: BlockHash,
                     parent_hash: BlockHash | None, token_ids: Sequence[int]) -> None:
        if self._is_written_through:
            self._to_write.append((block_id, block_hash, tuple(token_ids)))

    def block_evicted(self, medium: str, block_id: int, entry: CachedBlock,
                      is_kv_intact: bool) -> None:
        """Spill the evicted block to the host tier (module docstring); not a block whose KV
        an elastic shrink overwrites now."""
        host = self.host
        if host is None or not is_kv_intact:
            return
        cached_id = host.pool.prefix_cache.lookup(entry.block_hash, entry.token_ids)
        if cached_id is not None:  # already spilled once: only its recency changes
            if host.pool.is_evictable(cached_id):
                host.pool.retain([cached_id])
                host.pool.free([cached_id])
            return
        if host.pool.num_allocatable_blocks == 0:
            self._num_dropped_spills += 1
            return
        [host_id] = host.pool.allocate(1)
        host.pool.publish(host_id, entry.block_hash, entry.token_ids)
        self.transfers.device_to_host([block_id], [host_id], hold=True)
        self._num_spilled += 1
        self.device_pool.listeners.block_spilled(block_id)

    def pool_resizing(self, medium: str) -> None:
        """Copies in flight first: the resize may move or zero blocks they read or write."""
        self.transfers.wait_all()

    # ---------------------------------------------------------------- reload
    def find_below(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
                   first_block: int, num_blocks: int) -> TierMatch:
        """Blocks `first_block .. num_blocks - 1` of a prefix found in the host tier, on disk,
        then in the shared tier, while the chain holds; nothing read, nothing taken
        (`TierLookup.find`: at most one round trip to Redis)."""
        return self._lookup.find(block_hashes, token_ids, first_block, num_blocks)

    def validate(self, match: TierMatch, token_ids: Sequence[int], first_block: int) -> None:
        """Read the match's disk and shared blocks; the match ends before the first that
        fails (`TierLookup.validate`: one MGET for the shared ones)."""
        self._lookup.validate(match, token_ids, first_block)

    def hold(self, match: TierMatch) -> None:
        """Take a reference on the match's host blocks, so that nothing evicts them while the
        device blocks they are copied into are allocated (which may spill to the host)."""
        host_ids = [source for source in match.sources if isinstance(source, int)]
        if host_ids:
            self.host.pool.retain(host_ids)

    def reload(self, match: TierMatch, device_ids: Sequence[int]) -> dict[str, int]:
        """Queue the copies of a validated, held match into `device_ids` (new device blocks;
        the hold passes to the queue); returns the blocks per source tier."""
        counts = dict.fromkeys(TIERS[1:], 0)
        for source, device_id in zip(match.sources, device_ids, strict=True):
            if isinstance(source, LoadedBlock):
                self.transfers.disk_to_device(source.block.kv, source.block.scales, device_id)
                counts[source.tier] += 1
            else:
                self.transfers.host_to_device([source], [device_id])
                counts[HOST] += 1
        for tier, count in counts.items():
            self._num_reloaded[tier] += count
        return counts

    # ------------------------------------------------------------------ swap
    def swap_out(self, device_ids: Sequence[int]) -> list[int] | None:
        """Host blocks holding a copy of `device_ids` (queued), owned by the caller; None if
        the host tier has no room for all of them."""
        if self.host is None or self.host.pool.num_allocatable_blocks < len(device_ids):
            return None
        host_ids = self.host.pool.allocate(len(device_ids))
        self.transfers.device_to_host(device_ids, host_ids)
        return host_ids

    def swap_in(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> None:
        """Queue the copies back; the caller's references on `host_ids` pass to the queue,
        which frees them once copied."""
        self.transfers.host_to_device(host_ids, device_ids)

    def free_swapped(self, host_ids: Sequence[int]) -> None:
        """A swapped sequence ended without resuming (aborted): its host blocks go back."""
        self.host.pool.free(list(reversed(host_ids)))

    # ------------------------------------------------------------- the step
    def before_step(self, written_block_ids: Callable[[], Collection[int]] = frozenset) -> None:
        """Run the queued copies (before the step's model); `written_block_ids()`: the device
        blocks the step writes (`KVTransfers.run`). If a copy fails, the blocks it was to fill
        leave the device's prefix cache before the error goes on (`_unpublish`)."""
        self.transfers.run(written_block_ids)

    def step_ended(self, next_step: int) -> None:
        self.after_step()

    def step_rolled_back(self) -> None:
        """A failed step: what it published is not written through (`roll_back` freed its
        blocks, which may hold another request's KV by the next step that succeeds)."""
        self._to_write.clear()

    def after_step(self) -> None:
        """Write the blocks the step published through to the tiers that want them (off the
        critical path: each tier's writer thread does the I/O; one snapshot serves all).
        Only a block still cached under the hash it was published with is written: its KV
        is that hash's (a block freed and reused since holds someone else's)."""
        if not self._to_write:
            return
        pending, self._to_write = self._to_write, []
        pending = [item for item in pending if self._still_holds(item[0], item[1])]
        hashes = [block_hash for _, block_hash, _ in pending]
        wanted = [(tier, tier.wanted(hashes)) for tier in self.tiers]
        wanted = [(tier, hashes) for tier, hashes in wanted if hashes]
        pending = [item for item in pending if any(item[1] in hashes for _, hashes in wanted)]
        if not pending:
            return
        snapshot = self.transfers.snapshot([block_id for block_id, _, _ in pending])
        for row, (_, block_hash, token_ids) in enumerate(pending):
            scales = None if snapshot.scales is None else snapshot.scales[row]
            for tier, hashes in wanted:
                if block_hash in hashes:
                    tier.store(block_hash, token_ids, snapshot.kv[row], scales, snapshot.ready)

    def _still_holds(self, block_id: int, block_hash: BlockHash) -> bool:
        entry = self.device_pool.prefix_cache.entry(block_id)
        return entry is not None and entry.block_hash == block_hash

    def close(self) -> None:
        """Clean shutdown: finish every copy, write spilled host blocks the disk lacks, wait
        for every tier's writes (the shared tier's: a bounded wait), farthest tier first."""
        self.transfers.synchronize()
        self.after_step()
        host, disk = self.host, self.disk
        if host is not None and disk is not None:
            for host_id in host.pool.evictable_block_ids():
                _write_host_block(host, host_id, disk)
        for tier in reversed(self.tiers):
            tier.close()
        if self in self.device_pool.listeners:  # the pool would keep this and the KV alive
            self.device_pool.listeners.remove(self)

    def reset(self) -> None:
        """With no sequence swapped: spilled host blocks dropped, counters zero (the disk
        keeps its files: surviving is its point)."""
        self.transfers.synchronize()
        self._to_write.clear()
        for tier in self.tiers:
            tier.reset()
        self.reset_counters()

    # -------------------------------------------------------------- reporting
    def stats(self) -> KVTierStats:
        stats = {tier.name: tier.stats() for tier in self.tiers}
        return KVTierStats(
            host=stats.get(HOST), disk=stats.get(DISK), shared=stats.get(SHARED),
            num_spilled_blocks=self._num_spilled,
            num_dropped_spills=self._num_dropped_spills,
            num_reloaded_blocks=dict(self._num_reloaded),
            bytes_per_block=self.bytes_per_block,
        )

    def check_invariants(self, num_swapped_host_blocks: int = 0) -> None:
        """Assert the tiers' invariants; `num_swapped_host_blocks` is what swapped sequences
        hold, so that at quiescence the host's used blocks are exactly those."""
        for tier in self.tiers:
            tier.flush()
            tier.check_invariants()
        held = self.transfers.num_held_host_blocks
        host_used = 0 if self.host is None else self.host.pool.num_used_blocks
        assert host_used == num_swapped_host_blocks + held, "host blocks leaked"


class _HostToDisk(KVListener):
    """The host pool's listener: a spilled block the host evicts goes to disk if not there."""

    def __init__(self, host: HostKVTier, disk: DiskKVTier) -> None:
        self.host = host
        self.disk = disk

    def block_evicted(self, medium: str, block_id: int, entry: CachedBlock,
                      is_kv_intact: bool) -> None:
        if not self.disk.contains(entry.block_hash):
            _write_host_block(self.host, block_id, self.disk, entry)


def _write_host_block(host: HostKVTier, host_id: int, disk: DiskKVTier,
                      entry: CachedBlock | None = None) -> None:
    """Hand a copy of a cached host block to the disk tier (the block itself may be reused
    as soon as this returns)."""
    if entry is None:
        entry = host.pool.prefix_cache.entry(host_id)
    if entry is None or disk.contains(entry.block_hash):
        return
    cache = host.kv_cache
    scales = None if cache.scales is None else cache.scales[host_id].clone()
    disk.store(entry.block_hash, entry.token_ids, cache.tensor[host_id].clone(), scales)


def _nothing_to_release(host_ids: Sequence[int]) -> None:
    raise AssertionError("no host tier holds blocks")


def _unpublish(device_pool: BlockPool, host_pool: BlockPool | None, device_ids: list[int],
               host_ids: list[int]) -> None:
    """Blocks a failed copy left without their KV: reloaded or swapped-in device blocks
    (published at admission; the step's roll-back frees them) and spilled host blocks
    (published when spilled) must not be found under their hashes."""
    for block_id in device_ids:
        device_pool.unpublish(block_id)
    for block_id in host_ids:
        assert host_pool is not None, "a host block without a host tier"
        host_pool.unpublish(block_id)

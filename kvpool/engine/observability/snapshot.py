"""`take_kv_snapshot(...)`: an engine's KV memory as one `KVSnapshot`, between steps.

It reads the narrow parts it needs, never the engine: the KV memory, the unfinished requests,
where swapped sequences' blocks are (the KV manager's), the step count, the pool's rates and
the KV connector's live leases (a kv_producer keeps a handed-over prompt's blocks for its
decode workers: used blocks that may be in no sequence's table).
A hybrid model's KV cache groups each have their pools ("device/g1", ...) and each sequence
its table per group.

Each pool is read by `kvpool.memory.pool_view.take_pool_view`. The holders of each block come
from the sequences' block tables: every table of every unfinished request (waiting ones hold
no device blocks; a swapped sequence's blocks are on the host, listed as its
`host_block_ids`); the leases on each device block from the connector's `leased_block_ids`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

from kvpool.engine.sequence import Request, Sequence, SequenceStatus
from kvpool.formats.kv_media import group_medium
from kvpool.formats.kv_snapshot import (
    USED,
    DerivedFigures,
    KVSnapshot,
    PoolView,
    SequenceView,
)
from kvpool.formats.snapshot_runs import short_hash
from kvpool.memory.block_pool import BlockPoolStats
from kvpool.memory.hybrid_memory import HybridKVMemory
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.pool_view import take_pool_view
from kvpool.memory.tiers.kv_tiers import SwappedKV

SwappedKVOf = Callable[[Sequence], SwappedKV | None]  # a sequence's host blocks while swapped


def take_kv_snapshot(memory: KVMemory | HybridKVMemory, requests: Iterable[Request],
                     swapped_kv: SwappedKVOf, num_steps: int,
                     rates: tuple[float, float, float],
                     leases: Mapping[int, int] | None = None) -> KVSnapshot:
    """The pools, the unfinished requests' sequences and the derived figures, after
    `num_steps` steps; `rates`: the device pool's (alloc/s, free/s, window seconds);
    `leases`: live leases per device block id (`KVConnectorBase.leased_block_ids`). Every
    pool with a prefix cache is drawn: the device's and the host tier's, per KV cache group
    (named as KV events name them: "device", "host", "device/g1", ...)."""
    pool = memory.pool
    sequences = _sequence_views(requests, swapped_kv)
    pools = {}
    for group_pool, group in memory.cache_pools():
        tables = [seq.blocks_in(group_pool.medium, group) for seq in sequences]
        name = group_medium(group_pool.medium, group)
        pools[name] = take_pool_view(group_pool, tables, leases if name == "device" else None)
    summaries = {tier.name: tier.summary() for tier in memory.tiers.tiers if tier.pool is None}
    stats = memory.block_stats()  # a hybrid pool's: over every group, in first-group blocks
    return KVSnapshot(
        time=time.time(), step=num_steps, pools=pools,
        sequences=tuple(sequences), stats=stats,
        derived=_derived(pools["device"], stats, rates),
        disk=summaries.get("disk"), shared=summaries.get("shared"),
        recent_evictions=tuple(short_hash(h) for h in pool.recent_evictions),
    )


def _sequence_views(requests: Iterable[Request],
                    swapped_kv: SwappedKVOf) -> list[SequenceView]:
    running = SequenceStatus.RUNNING
    views = []
    for request in requests:
        request_id, salt = request.request_id, request.cache_salt
        for seq in request.sequences:
            if seq.is_finished:
                continue
            swapped = swapped_kv(seq)
            host = [tuple(ids) for ids in swapped.host_ids] if swapped else [()]
            device = [tuple(ids) for ids in seq.block_table.group_live_block_ids]
            status = ("swapped" if swapped else "running" if seq.status is running
                      else "waiting")
            views.append(SequenceView(
                request_id, seq.index, status, seq.num_tokens, seq.num_computed_tokens,
                device[0], host[0], cache_salt=salt, group_block_ids=tuple(device[1:]),
                group_host_block_ids=tuple(host[1:])))
    return views


def _derived(device: PoolView, stats: BlockPoolStats,
             rates: tuple[float, float, float]) -> DerivedFigures:
    num_used = stats.num_used_blocks
    num_shared = sum(run.count for run in device.runs if run.state == USED and run.ref_count > 1)
    alloc_rate, free_rate, window = rates
    return DerivedFigures(
        internal_fragmentation=(stats.num_unfilled_slots / (num_used * stats.block_size)
                                if num_used else 0.0),
        free_list_size=stats.num_free_blocks,
        alloc_rate=alloc_rate, free_rate=free_rate, rate_window_s=window,
        cached_fraction=stats.num_cached_blocks / stats.num_blocks if stats.num_blocks else 0.0,
        shared_fraction=num_shared / num_used if num_used else 0.0,
        num_shared_blocks=num_shared,
        num_leased_blocks=len(device.leases),
    )

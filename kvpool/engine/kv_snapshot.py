"""`take_kv_snapshot(engine)`: the engine's KV memory as one `KVSnapshot`, between steps.

The pool keeps its per-block facts in plain lists (reference counts, filled slots, online flags,
last-use times); this module copies them into numpy arrays once and finds the runs of equal
blocks there, so the cost is a few passes over arrays rather than a Python object per block.
The holders of each block come from the sequences' block tables: every table of every
unfinished request (waiting ones hold no device blocks; a swapped sequence's blocks are on the
host, listed as its `host_block_ids`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvpool.engine.sequence import SequenceStatus
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.pool_snapshot import (
    BLOCK_STATES,
    CACHED,
    FREE,
    OFFLINE,
    USED,
    BlockRun,
    DerivedFigures,
    KVSnapshot,
    PoolView,
    SequenceView,
    short_hash,
)

if TYPE_CHECKING:
    from kvpool.engine.engine import LLMEngine

_STATE_CODE = {state: code for code, state in enumerate(BLOCK_STATES)}
_AGE_DECIMALS = 3  # ages are rounded to milliseconds, so blocks touched together form one run


@dataclass(frozen=True, slots=True)
class _Holders:
    """Who holds each block: `code[b]` is -1 (nobody), a sequence index, or `len(sequences)` +
    k for the k-th set of several holders (`sets[k]`)."""

    code: np.ndarray
    sets: list[tuple[int, ...]]
    num_sequences: int

    def holders(self, code: int) -> tuple[int, ...]:
        if code < 0:
            return ()
        if code < self.num_sequences:
            return (code,)
        return self.sets[code - self.num_sequences]


def take_kv_snapshot(engine: LLMEngine) -> KVSnapshot:
    """The engine's pools, sequences and derived figures (call between steps)."""
    pool = engine.kv_memory.pool
    sequences = _sequence_views(engine)
    tables = [seq.block_ids for seq in sequences]
    pools = {"device": take_pool_view(pool, tables)}
    tiers = engine.kv_tiers
    if tiers.host is not None:
        host_tables = [seq.host_block_ids for seq in sequences]
        pools["host"] = take_pool_view(tiers.host.pool, host_tables)
    disk = None
    if tiers.disk is not None:
        disk_stats = tiers.disk.stats()
        disk = {"num_blocks": disk_stats.num_blocks, "num_bytes": disk_stats.num_bytes}
    stats = pool.stats()
    return KVSnapshot(
        time=time.time(), step=engine.stats().num_steps, pools=pools,
        sequences=tuple(sequences), stats=stats,
        derived=_derived(pools["device"], stats, engine.kv_rates.rates()),
        disk=disk, recent_evictions=tuple(short_hash(h) for h in pool.recent_evictions),
    )


def _sequence_views(engine: LLMEngine) -> list[SequenceView]:
    kv = engine.scheduler.kv
    views = []
    for request in engine.requests.values():
        for seq in request.sequences:
            if seq.is_finished:
                continue
            swapped = kv.swapped_host_blocks(seq)
            status = "swapped" if swapped else (
                "running" if seq.status is SequenceStatus.RUNNING else "waiting")
            views.append(SequenceView(
                request.request_id, seq.index, status, seq.num_tokens, seq.num_computed_tokens,
                tuple(seq.block_table.block_ids), tuple(swapped), cache_salt=request.cache_salt))
    return views


def take_pool_view(pool: BlockPool, tables: list[tuple[int, ...]]) -> PoolView:
    """One pool; `tables[i]` are the block ids sequence i holds in it."""
    capacity = pool.capacity_blocks
    ref_counts = np.array(pool._ref_counts, dtype=np.int64)
    online = np.array(pool._is_online, dtype=bool)
    state = np.where(online, np.where(ref_counts > 0, _STATE_CODE[USED], _STATE_CODE[FREE]),
                     _STATE_CODE[OFFLINE]).astype(np.int64)
    lru = tuple(pool._evictable_ids)
    if lru:
        state[np.fromiter(lru, dtype=np.int64, count=len(lru))] = _STATE_CODE[CACHED]
    filled = np.array(pool._num_filled_slots, dtype=np.int64)
    holders = _holders(capacity, tables)
    columns = np.stack([state, ref_counts, filled, holders.code])
    starts = _run_starts(columns)
    ends = np.append(starts[1:], capacity)
    runs = tuple(
        BlockRun(int(start), int(end - start), BLOCK_STATES[int(state[start])],
                 int(ref_counts[start]), int(filled[start]),
                 holders.holders(int(holders.code[start])))
        for start, end in zip(starts.tolist(), ends.tolist(), strict=True))
    entries = pool.prefix_cache._entry_by_block_id
    hashes = {block_id: short_hash(entry.block_hash) for block_id, entry in entries.items()}
    layout = pool.layout
    return PoolView(layout.block_size, pool.num_blocks, capacity, layout.bytes_per_block,
                    layout.dtype, runs, hashes, _age_runs(pool, online), lru)


def _holders(capacity: int, tables: list[tuple[int, ...]]) -> _Holders:
    code = np.full(capacity, -1, dtype=np.int64)
    lengths = [len(table) for table in tables]
    if not sum(lengths):
        return _Holders(code, [], len(tables))
    ids = np.fromiter((b for table in tables for b in table), dtype=np.int64, count=sum(lengths))
    owners = np.repeat(np.arange(len(tables), dtype=np.int64), lengths)
    counts = np.bincount(ids, minlength=capacity)
    code[ids] = owners  # right wherever a block has one holder
    sets: list[tuple[int, ...]] = []
    shared = counts[ids] > 1
    if shared.any():
        order = np.lexsort((owners[shared], ids[shared]))
        shared_ids, shared_owners = ids[shared][order], owners[shared][order]
        boundaries = np.flatnonzero(np.diff(shared_ids)) + 1
        set_index: dict[tuple[int, ...], int] = {}
        for group_ids, group_owners in zip(np.split(shared_ids, boundaries),
                                           np.split(shared_owners, boundaries), strict=True):
            key = tuple(dict.fromkeys(group_owners.tolist()))  # a table lists a block once
            index = set_index.setdefault(key, len(sets))
            if index == len(sets):
                sets.append(key)
            code[group_ids[0]] = len(tables) + index
    return _Holders(code, sets, len(tables))


def _run_starts(columns: np.ndarray) -> np.ndarray:
    """Indices where any column changes value (0 always starts a run)."""
    changed = (columns[:, 1:] != columns[:, :-1]).any(axis=0)
    return np.concatenate(([0], np.flatnonzero(changed) + 1))


def _age_runs(pool: BlockPool, online: np.ndarray) -> tuple[tuple[int, int, float | None], ...]:
    """Runs of equal last-use age over online ids; None for a block not used since start."""
    ages = np.round(pool.now - np.array(pool._last_use, dtype=np.float64), _AGE_DECIMALS)
    key = np.where(online, np.nan_to_num(np.maximum(ages, 0.0), nan=-1.0), -2.0)
    starts = _run_starts(key[np.newaxis])
    ends = np.append(starts[1:], len(key))
    return tuple((int(start), int(end - start), None if key[start] == -1.0 else float(key[start]))
                 for start, end in zip(starts.tolist(), ends.tolist(), strict=True)
                 if online[start])


def _derived(device: PoolView, stats, rates: tuple[float, float, float]) -> DerivedFigures:
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
    )

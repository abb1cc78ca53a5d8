"""`take_pool_view(pool, tables, leases)`: one block pool as a `PoolView` of runs of equal
blocks, with the live leases on its blocks.

The pool keeps its per-block facts in plain lists (reference counts, filled slots, online flags,
last-use times); they are copied into numpy arrays once and the runs are found there, so the
cost is a few passes over arrays, not a Python object per block: a 100,000-block pool takes
tens of milliseconds (`kvpool bench snapshot`). Reads the pool's private lists on purpose: this
module is the pool's photographer and must not slow its hot paths with accessors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter

import numpy as np

from kvpool.formats.kv_snapshot import (
    BLOCK_STATES,
    CACHED,
    FREE,
    OFFLINE,
    USED,
    BlockRun,
    PoolView,
)
from kvpool.formats.snapshot_runs import SHORT_HASH_BYTES, ShortHashes
from kvpool.memory.block_pool import BlockPool

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


def take_pool_view(pool: BlockPool, tables: list[tuple[int, ...]],
                   leases: Mapping[int, int] | None = None) -> PoolView:
    """One pool; `tables[i]` are the block ids sequence i holds in it, `leases` the live
    leases on its blocks (block id -> how many; a kv_producer's device pool)."""
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
    counts = (ends - starts).tolist()
    holder_sets = [holders.holders(code) for code in holders.code[starts].tolist()]
    states = [BLOCK_STATES[code] for code in state[starts].tolist()]
    runs = tuple(map(BlockRun, starts.tolist(), counts, states, ref_counts[starts].tolist(),
                     filled[starts].tolist(), holder_sets))
    layout = pool.layout
    return PoolView(layout.block_size, pool.num_blocks, capacity, layout.bytes_per_block,
                    layout.dtype, runs, _short_hashes(pool), _age_runs(pool, online), lru,
                    dict(leases or {}))


def _short_hashes(pool: BlockPool) -> ShortHashes:
    entries = pool.prefix_cache._entry_by_block_id
    if not entries:
        return ShortHashes(np.zeros(0, dtype=np.int64), "")
    ids = np.fromiter(entries.keys(), dtype=np.int64, count=len(entries))
    full = b"".join(map(attrgetter("block_hash"), entries.values()))
    order = np.argsort(ids, kind="stable")
    digests = np.frombuffer(full, dtype=np.uint8).reshape(len(ids), -1)
    labels = digests[order, :SHORT_HASH_BYTES].tobytes().hex()
    return ShortHashes(ids[order], labels)


def _holders(capacity: int, tables: list[tuple[int, ...]]) -> _Holders:
    """Each block's holder code. A block held by several tables gets the code of its set of
    holders; sets are told apart by two independent 64-bit sums of mixed member indices
    (vectorised; two different sets agreeing on both is a 2**-128 accident)."""
    code = np.full(capacity, -1, dtype=np.int64)
    lengths = [len(table) for table in tables]
    total = sum(lengths)
    if not total:
        return _Holders(code, [], len(tables))
    ids = np.fromiter((b for table in tables for b in table), dtype=np.int64, count=total)
    owners = np.repeat(np.arange(len(tables), dtype=np.int64), lengths)
    code[ids] = owners  # right wherever a block has one holder
    shared = np.bincount(ids, minlength=capacity)[ids] > 1
    if not shared.any():
        return _Holders(code, [], len(tables))
    order = np.lexsort((owners[shared], ids[shared]))
    shared_ids, shared_owners = ids[shared][order], owners[shared][order]
    starts = np.flatnonzero(np.diff(shared_ids, prepend=-1))
    keys = np.stack([np.add.reduceat(_mix(shared_owners, salt), starts)
                     for salt in (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)], axis=1)
    _, first_group, set_of_group = np.unique(keys, axis=0, return_index=True,
                                              return_inverse=True)
    ends = np.append(starts[1:], len(shared_ids))
    sets = [tuple(shared_owners[starts[g]:ends[g]].tolist()) for g in first_group.tolist()]
    code[shared_ids[starts]] = len(tables) + set_of_group.reshape(-1)
    return _Holders(code, sets, len(tables))


def _mix(values: np.ndarray, salt: int) -> np.ndarray:
    """A 64-bit mixing of each value (splitmix64's finaliser), wrapping."""
    with np.errstate(over="ignore"):
        x = values.astype(np.uint64) * np.uint64(salt) + np.uint64(salt >> 7)
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


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

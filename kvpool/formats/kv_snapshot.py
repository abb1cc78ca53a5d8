"""The KV snapshot format: every block, every block table, and derived figures.

The producers stay with their owners: `kvpool.memory.pool_view.take_pool_view` reads one
`BlockPool`; `kvpool.engine.observability.snapshot` puts the device pool, the host tier's pool
and every sequence's table together into a `KVSnapshot`, between two steps.
Reading is vectorised (numpy over the pool's per-block lists), so a 100,000-block pool is
photographed in tens of milliseconds (`kvpool bench snapshot`).

Block states (`BlockRun.state`):

    free      ref_count 0, no hash: on the free list
    used      ref_count > 0: held by `holders`, the sequences whose tables list it, and by
              `leases`, references held for transfers (kv_transfer_config): a producer's live
              leases for decode workers, a consumer's loads until their request ends; a used
              block with leases and no holder is KV kept for a handover
    cached    ref_count 0, hashed: kept for prefix reuse; evicted LRU when nothing is free.
              Cached is not leaked: it is free memory that still remembers a prefix.
    offline   no memory behind the id: the null block, or a segment an elastic pool gave back
    other     (a tenant's view only) used, but by another tenant's sequences

A tenant's view (`KVSnapshot.restricted_to`) keeps hashes and ages only for blocks its own
sequences hold, and has an empty "lru" and "recent_evictions".

Serialisation (`to_json`, `from_json`; format "kvpool.kv_snapshot", version 1). Blocks are runs
of consecutive ids with equal (state, ref_count, filled slots, holders), not one object each:

    {"format": "kvpool.kv_snapshot", "version": 1,
     "time": unix seconds, "step": engine steps since start-up,
     "pools": {"device": POOL, "host": POOL (only with a host tier),
               "device/g1": POOL, "host/g1": POOL, ...},  a hybrid model's other KV cache
                                                       groups (`kv_media.group_medium`)
     "disk": {"num_blocks": n, "num_bytes": b} or null,
     "shared": {"is_up": 0 or 1, "num_stored_blocks": n, "num_loaded_blocks": n} or null,
     "sequences": [{"request_id": "req-3", "index": 0, "status": "running",
                    "num_tokens": 40, "num_computed_tokens": 40,
                    "block_ids": [[7, 3]],            runs [first id, count], table order
                    "host_block_ids": [],             a swapped sequence's host blocks
                    "group_block_ids": [[[9, 2]]],    groups past the first, if any: runs
                    "group_host_block_ids": [[]],       per group, device and host
                    "tenant": "acme"}, ...],          only when the server knows it
     "stats": BlockPoolStats of the device pool, as a dict,
     "derived": DerivedFigures as a dict,
     "recent_evictions": ["1a2b3c4d", ...]}           short hashes, oldest first

    POOL = {"block_size": 16, "num_blocks": online, "capacity_blocks": ids (null included),
            "bytes_per_block": 36864, "kv_cache_dtype": "bfloat16",
            "runs": [[first_id, count, state, ref_count, num_filled_slots, [holder, ...]], ...],
            "hashes": [[first_id, "1a2b3c4d5e6f7a8b"], ...],   runs of consecutive hashed ids:
                                                       their short hashes, concatenated
            "ages": [[first_id, count, age_s], ...],   seconds since the block last changed
                                                       hands (allocated, revived, released);
                                                       null: not used since start-up
            "lru": [block_id, ...],                    cached blocks, next evicted first
            "leases": [[first_id, count, n], ...]}     runs of ids n > 0 live leases hold
                                                       (the device pool of a kv_producer)

A holder is an index into "sequences". The runs cover ids 0 .. capacity_blocks - 1 in order.
A short hash is `kvpool.formats.snapshot_runs.short_hash`: the first bytes of the block's
chained hash, in hex.

Compatibility: version 1 grows by optional keys only ("leases", "derived.num_leased_blocks",
"group_block_ids", ...). A reader takes a missing one as empty or zero, so every version-1 file
stays readable, and it skips keys it does not know, so a newer version-1 file reads too (readers
from before "num_leased_blocks" refused unknown keys in "derived" and "stats"). A change that a
reader would misread (a key's meaning, a run's fields) takes a new version.

Invariants (the snapshot tests check them against the live pool): the state counts equal
`BlockPoolStats`; a used block's ref_count equals its number of holders plus its leases, and
each holder's table lists it (on a kv_consumer, a handed-over prompt's blocks also keep one
reference of the connector's until its request ends); the runs cover every id exactly once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

from kvpool.formats.snapshot_runs import (
    count_runs,
    expand_count_runs,
    expand_hash_runs,
    expand_id_runs,
    hash_runs,
    id_runs,
)
from kvpool.memory.block_pool import DEVICE, BlockPoolStats

SNAPSHOT_FORMAT = "kvpool.kv_snapshot"
SNAPSHOT_VERSION = 1
FREE, USED, CACHED, OFFLINE, OTHER = "free", "used", "cached", "offline", "other"
BLOCK_STATES = (FREE, USED, CACHED, OFFLINE, OTHER)


@dataclass(frozen=True, slots=True)
class BlockRun:
    """`count` consecutive block ids from `first_id` that look the same."""

    first_id: int
    count: int
    state: str
    ref_count: int
    num_filled_slots: int
    holders: tuple[int, ...] = ()  # indices into KVSnapshot.sequences

    @property
    def block_ids(self) -> range:
        return range(self.first_id, self.first_id + self.count)


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One block, expanded from its run (`PoolView.blocks`)."""

    block_id: int
    state: str
    ref_count: int
    holders: tuple[int, ...]
    short_hash: str | None
    num_filled_slots: int
    age_s: float | None  # None: offline, or not used since start-up
    num_leases: int = 0  # live leases holding it for decode workers


@dataclass(frozen=True, slots=True)
class PoolView:
    """One block pool (device or host) as the snapshot saw it."""

    block_size: int
    num_blocks: int  # online
    capacity_blocks: int  # ids, the null block included
    bytes_per_block: int
    kv_cache_dtype: str
    runs: tuple[BlockRun, ...]
    hashes: Mapping[int, str]  # block id -> short hash, every hashed block
    ages: tuple[tuple[int, int, float | None], ...]  # (first_id, count, age_s), online ids
    lru: tuple[int, ...]  # cached ids, next evicted first
    leases: Mapping[int, int] = field(default_factory=dict)  # block id -> live leases (> 0)

    def count(self, state: str) -> int:
        """Blocks in `state`."""
        return sum(run.count for run in self.runs if run.state == state)

    def blocks(self) -> Iterator[BlockInfo]:
        """Every id, ascending, expanded from the runs (O(capacity_blocks))."""
        age_of: dict[int, float | None] = {}
        for first_id, count, age in self.ages:
            for block_id in range(first_id, first_id + count):
                age_of[block_id] = age
        for run in self.runs:
            for block_id in run.block_ids:
                yield BlockInfo(block_id, run.state, run.ref_count, run.holders,
                                self.hashes.get(block_id), run.num_filled_slots,
                                age_of.get(block_id), self.leases.get(block_id, 0))

    def to_json(self) -> dict[str, Any]:
        return {
            "block_size": self.block_size, "num_blocks": self.num_blocks,
            "capacity_blocks": self.capacity_blocks, "bytes_per_block": self.bytes_per_block,
            "kv_cache_dtype": self.kv_cache_dtype,
            "runs": [[r.first_id, r.count, r.state, r.ref_count, r.num_filled_slots,
                      list(r.holders)] for r in self.runs],
            "hashes": hash_runs(self.hashes),
            "ages": [list(age_run) for age_run in self.ages],
            "lru": list(self.lru),
            "leases": count_runs(self.leases),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> PoolView:
        return cls(
            block_size=int(doc["block_size"]), num_blocks=int(doc["num_blocks"]),
            capacity_blocks=int(doc["capacity_blocks"]),
            bytes_per_block=int(doc["bytes_per_block"]), kv_cache_dtype=str(doc["kv_cache_dtype"]),
            runs=tuple(BlockRun(int(f), int(c), str(s), int(r), int(n), tuple(map(int, h)))
                       for f, c, s, r, n, h in doc["runs"]),
            hashes=expand_hash_runs(doc["hashes"]),
            ages=tuple((int(f), int(c), None if a is None else float(a))
                       for f, c, a in doc["ages"]),
            lru=tuple(int(block_id) for block_id in doc["lru"]),
            leases=expand_count_runs(doc.get("leases", [])),
        )


@dataclass(frozen=True, slots=True)
class SequenceView:
    """One sequence (one completion of a request) and its block table."""

    request_id: str
    index: int  # which of the request's n completions
    status: str  # "running", "waiting" (never admitted, or preempted by recompute), "swapped"
    num_tokens: int
    num_computed_tokens: int
    block_ids: tuple[int, ...]  # its device block table, logical order (the first group's)
    host_block_ids: tuple[int, ...] = ()  # a swapped sequence's host blocks
    tenant: str | None = None  # set by the server (`with_tenants`); never by the engine
    cache_salt: str | None = field(default=None, compare=False)  # in memory only, never saved
    # A hybrid model's KV cache groups past the first: their tables' live blocks, and a
    # swapped sequence's host blocks, one tuple per group (pools "device/g1", "host/g1", ...).
    group_block_ids: tuple[tuple[int, ...], ...] = ()
    group_host_block_ids: tuple[tuple[int, ...], ...] = ()

    def blocks_in(self, medium: str, group: int = 0) -> tuple[int, ...]:
        """The blocks it holds in the pool of `medium` ("device" or "host") and `group`."""
        if group == 0:
            return self.block_ids if medium == DEVICE else self.host_block_ids
        groups = self.group_block_ids if medium == DEVICE else self.group_host_block_ids
        return groups[group - 1] if group <= len(groups) else ()

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "request_id": self.request_id, "index": self.index, "status": self.status,
            "num_tokens": self.num_tokens, "num_computed_tokens": self.num_computed_tokens,
            "block_ids": id_runs(self.block_ids), "host_block_ids": id_runs(self.host_block_ids),
        }
        if self.group_block_ids:
            doc["group_block_ids"] = [id_runs(ids) for ids in self.group_block_ids]
        if self.group_host_block_ids:
            doc["group_host_block_ids"] = [id_runs(ids) for ids in self.group_host_block_ids]
        if self.tenant is not None:
            doc["tenant"] = self.tenant
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> SequenceView:
        return cls(str(doc["request_id"]), int(doc["index"]), str(doc["status"]),
                   int(doc["num_tokens"]), int(doc["num_computed_tokens"]),
                   expand_id_runs(doc["block_ids"]), expand_id_runs(doc.get("host_block_ids", [])),
                   doc.get("tenant"),
                   group_block_ids=tuple(expand_id_runs(runs)
                                         for runs in doc.get("group_block_ids", [])),
                   group_host_block_ids=tuple(expand_id_runs(runs)
                                              for runs in doc.get("group_host_block_ids", [])))


@dataclass(frozen=True, slots=True)
class DerivedFigures:
    """What an operator reads off the pool (device pool; fractions of its online blocks)."""

    internal_fragmentation: float  # empty slots in used blocks / slots of used blocks
    free_list_size: int  # blocks on the free list (fresh), not counting cached ones
    alloc_rate: float  # blocks allocated per second over the last `rate_window_s`
    free_rate: float  # blocks released per second over the same window
    rate_window_s: float  # 0 when the engine has not stepped yet
    cached_fraction: float  # cached blocks / online blocks
    shared_fraction: float  # used blocks with ref_count > 1 / used blocks
    num_shared_blocks: int
    num_leased_blocks: int = 0  # blocks live leases hold for decode workers (a kv_producer)


@dataclass(frozen=True, slots=True)
class KVSnapshot:
    """The whole KV picture at one instant between steps (module docstring)."""

    time: float  # unix seconds
    step: int
    pools: dict[str, PoolView]  # "device", and "host" with a host tier
    sequences: tuple[SequenceView, ...]
    stats: BlockPoolStats  # the device pool's
    derived: DerivedFigures
    disk: dict[str, int] | None = None  # {"num_blocks", "num_bytes"} with a disk tier
    shared: dict[str, int] | None = None  # the shared tier's counts (module docstring)
    recent_evictions: tuple[str, ...] = ()  # short hashes the device evicted, oldest first
    version: int = SNAPSHOT_VERSION

    @property
    def device(self) -> PoolView:
        return self.pools["device"]

    def to_json(self) -> dict[str, Any]:
        return {
            "format": SNAPSHOT_FORMAT, "version": self.version, "time": self.time,
            "step": self.step,
            "pools": {name: view.to_json() for name, view in self.pools.items()},
            "disk": self.disk,
            "shared": self.shared,
            "sequences": [seq.to_json() for seq in self.sequences],
            "stats": asdict(self.stats),
            "derived": asdict(self.derived),
            "recent_evictions": list(self.recent_evictions),
        }

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> KVSnapshot:
        """ValueError for anything but a version-1 kvpool snapshot."""
        if not isinstance(doc, dict) or doc.get("format") != SNAPSHOT_FORMAT:
            raise ValueError(f"not a kvpool KV snapshot (expected format {SNAPSHOT_FORMAT!r})")
        if doc.get("version") != SNAPSHOT_VERSION:
            raise ValueError(f"KV snapshot version {doc.get('version')!r} is not supported "
                             f"(this kvpool reads version {SNAPSHOT_VERSION})")
        try:
            return cls(
                time=float(doc["time"]), step=int(doc["step"]),
                pools={name: PoolView.from_json(view) for name, view in doc["pools"].items()},
                sequences=tuple(SequenceView.from_json(seq) for seq in doc["sequences"]),
                stats=BlockPoolStats(**_known_fields(BlockPoolStats, doc["stats"])),
                derived=DerivedFigures(**_known_fields(DerivedFigures, doc["derived"])),
                disk=doc.get("disk"),
                shared=doc.get("shared"),
                recent_evictions=tuple(doc.get("recent_evictions", ())),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"malformed KV snapshot: {error!r}") from error

    def with_tenants(self, tenant_of: Callable[[str | None], str | None]) -> KVSnapshot:
        """The same snapshot with each sequence's `tenant` set from its cache salt."""
        sequences = tuple(replace(seq, tenant=tenant_of(seq.cache_salt))
                          for seq in self.sequences)
        return replace(self, sequences=sequences)

    def restricted_to(self, visible: Callable[[SequenceView], bool]) -> KVSnapshot:
        """A viewer's snapshot: only `visible` sequences are listed; a used block that only
        other sequences hold becomes "other", with no holders (its leases stay). Only blocks a
        visible sequence holds keep their hash and age; the LRU order and the recent
        evictions (blocks nobody holds) are dropped: a hash that stays after its request ended
        would let the viewer confirm a guess of another tenant's prompt. Counts and figures
        stay whole."""
        keep = [index for index, seq in enumerate(self.sequences) if visible(seq)]
        new_index = {old: new for new, old in enumerate(keep)}
        pools = {name: _restrict_pool(view, new_index) for name, view in self.pools.items()}
        sequences = tuple(self.sequences[index] for index in keep)
        return replace(self, pools=pools, sequences=sequences, recent_evictions=())


def _known_fields(cls: type, doc: dict[str, Any]) -> dict[str, Any]:
    """`doc`'s entries that name a field of `cls` (keys a newer version-1 writer added are
    skipped: module docstring)."""
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in doc.items() if key in names}


def _restrict_pool(view: PoolView, new_index: dict[int, int]) -> PoolView:
    runs, shown = [], set()
    for run in view.runs:
        holders = tuple(new_index[h] for h in run.holders if h in new_index)
        if holders:
            shown.update(run.block_ids)
        # Used with holders, none of them visible: another tenant's. Used with no holder at
        # all (a lease's alone) stays used: nobody's sequence holds it.
        state = OTHER if run.state == USED and run.holders and not holders else run.state
        runs.append(replace(run, state=state, holders=holders))
    hashes = {block_id: h for block_id, h in view.hashes.items() if block_id in shown}
    return replace(view, runs=tuple(runs), hashes=hashes, ages=_shown_ages(view.ages, shown),
                   lru=())


def _shown_ages(ages: tuple[tuple[int, int, float | None], ...], shown: set[int]
                ) -> tuple[tuple[int, int, float | None], ...]:
    """The age runs with every id outside `shown` set to None, equal neighbours merged (the
    runs still cover the same ids)."""
    merged: list[list] = []
    for first_id, count, age in ages:
        for block_id in range(first_id, first_id + count):
            block_age = age if block_id in shown else None
            last = merged[-1] if merged else None
            if last is not None and last[0] + last[1] == block_id and last[2] == block_age:
                last[1] += 1
            else:
                merged.append([block_id, 1, block_age])
    return tuple((first_id, count, age) for first_id, count, age in merged)

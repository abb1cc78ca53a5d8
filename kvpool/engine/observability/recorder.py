"""The KV allocation-event recorder behind `--kv-trace FILE` (`EngineConfig.kv_trace`).

The line format is `kvpool.formats.kv_trace`'s; this module only produces it. The engine owns
one recorder when a trace is configured, and None otherwise. The recorder is a `KVListener`
(`kvpool.memory.kv_listener`) registered once on the device side's fan-out
(`KVMemory.listeners`) by `start`, and unregistered by `close`.

Where events come from:

    engine      arrive, finish, step (`request_arrived`, `request_finished`, `step_ended`),
                and the step number every event carries (0 again after a device pool reset)
    KV manager  hit, alloc, free, fork, cow, preempt, swap_in (`prefix_hit`,
                `blocks_allocated`, `blocks_freed`, `table_forked`, `block_copied_on_write`,
                `sequence_preempted`, `sequence_swapped_in`); tentative blocks (speculative
                drafts) as alloc and free with "d": 1 (`drafts_allocated`, `drafts_dropped`)
    block pool  evict (`block_evicted`)
    KV tiers    spill (`block_spilled`)
    elastic     grow, shrink, and evict for the cached blocks a shrink drops (`pool_resized`)

Cost, and why it stays small: an event is one tuple appended to a list (kind, step, clock,
then its fields in the order `_FIELDS` names them); evictions and spills, which come one
block at a time from inside an allocation, gather into one event each until the next other
event. JSON is made once per step, after it (`step_ended`), and written with one `write` to a
buffered text file; `close` writes what is left and unregisters the recorder.

A `reset_stats` of a traced engine restarts the engine's step numbers from 0 and drops the
cached blocks without events (no block is referenced then, so reference counts still add up).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from kvpool.formats.kv_trace import EVENT_KINDS, TraceHeader
from kvpool.formats.snapshot_runs import short_hash
from kvpool.memory.block_pool import DEVICE
from kvpool.memory.kv_listener import KVListener, KVListeners

if TYPE_CHECKING:
    from kvpool.memory.block_pool import BlockPool
    from kvpool.memory.hybrid_memory import HybridKVMemory
    from kvpool.memory.kv_memory import KVMemory
    from kvpool.memory.prefix_cache import CachedBlock

# Each kind's keys after "e", "s" and "t", in the order its events hold them; a None value
# is left out of the line (the optional "k" of a hit, "m" of a shrink).
_FIELDS: dict[str, tuple[str, ...]] = {
    "arrive": ("r", "p", "n", "h"),
    "hit": ("r", "q", "b", "c", "k"),
    "alloc": ("r", "q", "b", "d"),
    "free": ("r", "q", "b", "d"),
    "evict": ("b",),
    "fork": ("r", "q", "from", "b"),
    "cow": ("r", "q", "src", "dst"),
    "preempt": ("r", "q", "m", "b"),
    "swap_in": ("r", "q", "b"),
    "spill": ("b",),
    "grow": ("n", "d"),
    "shrink": ("n", "d", "m"),
    "finish": ("r", "o", "why"),
    "step": ("u", "c", "f", "o"),
    "groups": ("p",),
}
assert tuple(_FIELDS) == EVENT_KINDS, "the recorder must know every kind of the format"

_encode = json.JSONEncoder(separators=(",", ":")).encode
_clock = time.perf_counter


class KVRecorder(KVListener):
    """Buffers one step's KV events and writes them as trace lines after it."""

    def __init__(self, file: TextIO, header: TraceHeader, pool: BlockPool,
                 group_pools: Sequence[BlockPool] = ()) -> None:
        """Write `header` to `file` (open for text); events' times count from now; `pool`
        (the device pool, the first KV cache group's) and `group_pools` (a hybrid model's
        other groups') are summed up at each step's end."""
        self._file = file
        self._pool = pool
        self._group_pools = tuple(group_pools)
        self._start = _clock()
        self._events: list[tuple[Any, ...]] = []
        self._evicted: list[int] = []  # gathering into one evict event
        self._spilled: list[int] = []  # gathering into one spill event
        self._evicted_at = self._spilled_at = 0.0
        self._listeners: KVListeners | None = None  # the fan-out it is registered on
        self.step = 0  # the engine step events belong to (the engine keeps it current)
        file.write(_encode(header.to_json()) + "\n")

    @classmethod
    def start(cls, path: str, memory: KVMemory | HybridKVMemory) -> KVRecorder:
        """A recorder writing to `path` (truncated), registered on `memory.listeners`."""
        layout, pool = memory.layout, memory.pool
        others = [(group, pool) for pool, group in memory.cache_pools()
                  if group and pool.medium == DEVICE]
        groups = tuple({"layers": len(memory.groups[group].layers),
                        "window": memory.groups[group].window,
                        "bytes_per_block": memory.groups[group].layout.bytes_per_block}
                       for group, _ in others)
        header = TraceHeader(time.time(), layout.block_size, pool.num_blocks,
                             memory.groups[0].layout.bytes_per_block, str(layout.dtype), groups)
        # Kept open for the engine's life; `close` (or the engine's finalizer) closes it.
        file = open(path, "w", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
        recorder = cls(file, header, pool, [group_pool for _, group_pool in others])
        memory.listeners.add(recorder)
        recorder._listeners = memory.listeners
        return recorder

    # ------------------------------------------------------------- events
    def _record(self, *event: Any) -> None:
        if self._evicted or self._spilled:
            self._gathered()
        self._events.append(event)

    def _gathered(self) -> None:
        """The evictions and spills gathered so far, as one event each."""
        if self._evicted:
            self._events.append(("evict", self.step, self._evicted_at, self._evicted))
            self._evicted = []
        if self._spilled:
            self._events.append(("spill", self.step, self._spilled_at, self._spilled))
            self._spilled = []

    def request_arrived(self, request_id: str, num_prompt_tokens: int, n: int,
                        block_hashes: Iterable[bytes]) -> None:
        self._record("arrive", self.step, _clock(), request_id, num_prompt_tokens, n,
                     [short_hash(block_hash) for block_hash in block_hashes])

    def prefix_hit(self, request_id: str, index: int, block_ids: Sequence[int],
                   num_cached_tokens: int, tokens_below: Mapping[str, int] | None) -> None:
        """`block_ids` retaken from the device's prefix cache; `tokens_below`: tokens per lower
        tier, when one served some."""
        self._record("hit", self.step, _clock(), request_id, index, list(block_ids),
                     num_cached_tokens, tokens_below)

    def blocks_allocated(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        self._record("alloc", self.step, _clock(), request_id, index, list(block_ids), None)

    def blocks_freed(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        self._record("free", self.step, _clock(), request_id, index, list(block_ids), None)

    def drafts_allocated(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        self._record("alloc", self.step, _clock(), request_id, index, list(block_ids), 1)

    def drafts_dropped(self, request_id: str, index: int, block_ids: Sequence[int]) -> None:
        self._record("free", self.step, _clock(), request_id, index, list(block_ids), 1)

    def table_forked(self, request_id: str, index: int, parent_index: int,
                     block_ids: Sequence[int]) -> None:
        self._record("fork", self.step, _clock(), request_id, index, parent_index,
                     list(block_ids))

    def block_copied_on_write(self, request_id: str, index: int, src_block_id: int,
                              dst_block_id: int) -> None:
        self._record("cow", self.step, _clock(), request_id, index, src_block_id, dst_block_id)

    def sequence_preempted(self, request_id: str, index: int, mode: str,
                           block_ids: Sequence[int]) -> None:
        self._record("preempt", self.step, _clock(), request_id, index, mode, list(block_ids))

    def sequence_swapped_in(self, request_id: str, index: int,
                            block_ids: Sequence[int]) -> None:
        self._record("swap_in", self.step, _clock(), request_id, index, list(block_ids))

    def block_evicted(self, medium: str, block_id: int, entry: CachedBlock,
                      is_kv_intact: bool) -> None:
        """Called once per block, from inside an allocation: gathered into one event."""
        self._evicted_one(block_id)

    def _evicted_one(self, block_id: int) -> None:
        if not self._evicted:
            self._evicted_at = _clock()
        self._evicted.append(block_id)

    def block_spilled(self, block_id: int) -> None:
        """A device block being evicted is copied to the host tier."""
        if not self._spilled:
            self._spilled_at = _clock()
        self._spilled.append(block_id)

    def pool_resized(self, medium: str, num_online_blocks: int, delta: int,
                     moved: Mapping[int, int], dropped: Sequence[int]) -> None:
        """A grow (delta > 0) or a shrink, which relocated the used blocks `moved` (old id ->
        new) and dropped the cached blocks `dropped`."""
        for block_id in dropped:
            self._evicted_one(block_id)
        if delta > 0:
            self._record("grow", self.step, _clock(), num_online_blocks, delta)
        else:
            pairs = [[old, new] for old, new in moved.items()] or None
            self._record("shrink", self.step, _clock(), num_online_blocks, -delta, pairs)

    def request_finished(self, request_id: str, num_output_tokens: int, reason: str) -> None:
        self._record("finish", self.step, _clock(), request_id, num_output_tokens, reason)

    def pool_cleared(self, medium: str) -> None:
        """The device pool's reset (an engine's `reset_stats`) restarts step numbers at 0."""
        if medium == self._pool.medium:
            self.step = 0

    # -------------------------------------------------------------- output
    def step_ended(self, next_step: int) -> None:
        """The step summary (the device pool's blocks), then this step's lines written;
        later events belong to `next_step`."""
        pool = self._pool
        self._record("step", self.step, _clock(), *_counts(pool))
        if self._group_pools:
            self._record("groups", self.step, _clock(),
                         [_counts(group_pool) for group_pool in self._group_pools])
        self.flush()
        self.step = next_step

    def flush(self) -> None:
        """Write the buffered events as lines (to the file's buffer: `close` flushes it)."""
        if self._evicted or self._spilled:
            self._gathered()
        if not self._events:
            return
        start, lines = self._start, []
        for kind, step, clock, *values in self._events:
            doc = {"e": kind, "s": step, "t": round(clock - start, 4)}
            for key, value in zip(_FIELDS[kind], values, strict=True):
                if value is not None:
                    doc[key] = value
            lines.append(_encode(doc))
        self._file.write("\n".join(lines) + "\n")
        self._events = []

    def close(self) -> None:
        """Write what is buffered, close the file and unregister (idempotent)."""
        if self._file.closed:
            return
        if self._listeners is not None:
            self._listeners.remove(self)
            self._listeners = None
        self.flush()
        self._file.close()


def _counts(pool: BlockPool) -> list[int]:
    """A step event's counts of `pool`: used, cached, free, online."""
    return [pool.num_used_blocks, pool.num_cached_blocks, pool.num_free_blocks, pool.num_blocks]

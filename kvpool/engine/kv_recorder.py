"""The KV allocation-event recorder behind `--kv-trace FILE` (`EngineConfig.kv_trace`).

The line format is `kvpool.engine.kv_trace`'s; this module only produces it. The engine owns
one recorder when a trace is configured, and None otherwise: every call site checks
`recorder is None` first, so an untraced engine pays one attribute test per call.

Where events come from:

    engine      arrive, finish, step (and the step number every event carries)
    KV manager  hit, alloc, free, fork, cow, preempt, swap_in (`KVCacheManager.recorder`)
    block pool  evict (`BlockPool.on_evict`)
    KV tiers    spill (`KVTiers.on_spill`)
    elastic     grow, shrink, and evict for the cached blocks a shrink drops
                (`ElasticKVPool.on_resize`)

Cost, and why it stays small: an event is one tuple appended to a list (kind, step, clock,
then its fields in the order `_FIELDS` names them); evictions and spills, which come one
block at a time from inside an allocation, gather into one event each until the next other
event. JSON is made once per step, after it (`end_step`), and written with one `write` to a
buffered text file; `close` writes what is left and detaches every hook.

A `reset_stats` of a traced engine restarts the engine's step numbers from 0 and drops the
cached blocks without events (no block is referenced then, so reference counts still add up).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TextIO

from kvpool.engine.kv_trace import EVENT_KINDS, TraceHeader
from kvpool.memory.elastic_pool import ElasticKVPool
from kvpool.memory.snapshot_runs import short_hash

if TYPE_CHECKING:
    from kvpool.engine.kv_manager import KVCacheManager
    from kvpool.engine.sequence import Request
    from kvpool.engine.sequence import Sequence as Seq
    from kvpool.memory.block_pool import BlockPool
    from kvpool.memory.block_table import BlockCopy
    from kvpool.memory.kv_memory import KVMemory

# Each kind's keys after "e", "s" and "t", in the order its events hold them; a None value
# is left out of the line (the optional "k" of a hit, "m" of a shrink).
_FIELDS: dict[str, tuple[str, ...]] = {
    "arrive": ("r", "p", "n", "h"),
    "hit": ("r", "q", "b", "c", "k"),
    "alloc": ("r", "q", "b"),
    "free": ("r", "q", "b"),
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
}
assert tuple(_FIELDS) == EVENT_KINDS, "the recorder must know every kind of the format"

_encode = json.JSONEncoder(separators=(",", ":")).encode
_clock = time.perf_counter


class KVRecorder:
    """Buffers one step's KV events and writes them as trace lines after it."""

    def __init__(self, file: TextIO, header: TraceHeader) -> None:
        """Write `header` to `file` (open for text); events' times count from now."""
        self._file = file
        self._start = _clock()
        self._events: list[tuple[Any, ...]] = []
        self._evicted: list[int] = []  # gathering into one evict event
        self._spilled: list[int] = []  # gathering into one spill event
        self._evicted_at = self._spilled_at = 0.0
        self._detach: list[tuple[object, str]] = []
        self.step = 0  # the engine step events belong to (the engine keeps it current)
        file.write(_encode(header.to_json()) + "\n")

    @classmethod
    def start(cls, path: str, memory: KVMemory, manager: KVCacheManager) -> KVRecorder:
        """A recorder writing to `path` (truncated), hooked into `memory` and `manager`."""
        layout, pool = memory.layout, memory.pool
        header = TraceHeader(time.time(), layout.block_size, pool.num_blocks,
                             layout.bytes_per_block, str(layout.dtype))
        # Kept open for the engine's life; `close` (or the engine's finalizer) closes it.
        file = open(path, "w", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
        recorder = cls(file, header)
        recorder._hook(manager, "recorder", recorder)
        recorder._hook(pool, "on_evict", recorder.evicted)
        recorder._hook(memory.tiers, "on_spill", recorder.spilled)
        if isinstance(memory.sizing, ElasticKVPool):
            recorder._hook(memory.sizing, "on_resize", recorder.resized)
        return recorder

    def _hook(self, owner: object, name: str, value: object) -> None:
        setattr(owner, name, value)
        self._detach.append((owner, name))

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

    def arrive(self, request_id: str, num_prompt_tokens: int, n: int,
               block_hashes: Iterable[bytes]) -> None:
        self._record("arrive", self.step, _clock(), request_id, num_prompt_tokens, n,
                     [short_hash(block_hash) for block_hash in block_hashes])

    def hit(self, seq: Seq, block_ids: Sequence[int], num_cached_tokens: int,
            below: dict[str, int] | None) -> None:
        """`block_ids` retaken from the device's prefix cache; `below`: tokens per lower
        tier, when one served some."""
        self._record("hit", self.step, _clock(), seq.request.request_id, seq.index,
                     list(block_ids), num_cached_tokens, below)

    def alloc(self, seq: Seq, block_ids: Sequence[int]) -> None:
        self._record("alloc", self.step, _clock(), seq.request.request_id, seq.index,
                     list(block_ids))

    def free(self, seq: Seq, block_ids: Sequence[int]) -> None:
        self._record("free", self.step, _clock(), seq.request.request_id, seq.index,
                     list(block_ids))

    def fork(self, parent: Seq, child_index: int, block_ids: Sequence[int]) -> None:
        self._record("fork", self.step, _clock(), parent.request.request_id, child_index,
                     parent.index, list(block_ids))

    def cow(self, seq: Seq, copy: BlockCopy) -> None:
        self._record("cow", self.step, _clock(), seq.request.request_id, seq.index,
                     copy.src_block_id, copy.dst_block_id)

    def preempt(self, seq: Seq, mode: str, block_ids: Sequence[int]) -> None:
        self._record("preempt", self.step, _clock(), seq.request.request_id, seq.index, mode,
                     list(block_ids))

    def swap_in(self, seq: Seq, block_ids: Sequence[int]) -> None:
        self._record("swap_in", self.step, _clock(), seq.request.request_id, seq.index,
                     list(block_ids))

    def evicted(self, block_id: int) -> None:
        """`BlockPool.on_evict`: called once per block, from inside an allocation."""
        if not self._evicted:
            self._evicted_at = _clock()
        self._evicted.append(block_id)

    def spilled(self, block_id: int) -> None:
        """`KVTiers.on_spill`: a device block being evicted is copied to the host tier."""
        if not self._spilled:
            self._spilled_at = _clock()
        self._spilled.append(block_id)

    def resized(self, num_online_blocks: int, delta: int, moved: dict[int, int],
                dropped: list[int]) -> None:
        """`ElasticKVPool.on_resize`: a grow (delta > 0) or a shrink, which relocated the
        used blocks `moved` (old id -> new) and dropped the cached blocks `dropped`."""
        for block_id in dropped:
            self.evicted(block_id)
        if delta > 0:
            self._record("grow", self.step, _clock(), num_online_blocks, delta)
        else:
            pairs = [[old, new] for old, new in moved.items()] or None
            self._record("shrink", self.step, _clock(), num_online_blocks, -delta, pairs)

    def finish(self, request: Request, why: str | None = None) -> None:
        """The request is done: its longest completion's length and (unless `why` says,
        e.g. "abort") that completion's finish reason."""
        longest = max(request.sequences, key=lambda seq: len(seq.output_token_ids))
        reason = why if why is not None else str(longest.finish_reason)
        self._record("finish", self.step, _clock(), request.request_id,
                     len(longest.output_token_ids), reason)

    # -------------------------------------------------------------- output
    def end_step(self, pool: BlockPool, next_step: int) -> None:
        """The step summary (the device pool's blocks), then this step's lines written;
        later events belong to `next_step`."""
        self._record("step", self.step, _clock(), pool.num_used_blocks, pool.num_cached_blocks,
                     pool.num_free_blocks, pool.num_blocks)
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
        """Write what is buffered, close the file and detach every hook (idempotent)."""
        if self._file.closed:
            return
        for owner, name in self._detach:
            setattr(owner, name, None)
        self._detach = []
        self.flush()
        self._file.close()

"""The KV allocation trace (`--kv-trace FILE`): its line format, and reading it back.

The engine's recorder (`kvpool.engine.observability.recorder`) writes one JSON object per line; this
module owns the format and is the one place that reads it (`kvpool inspect trace`, the
simulator's replay). The first line is the header, then events in the order they happened:

    {"format": "kvpool.kv_trace", "version": 1, "time": unix seconds at start,
     "block_size": 16, "num_blocks": online device blocks at start, "bytes_per_block": 36864,
     "kv_cache_dtype": "bfloat16",
     "groups": [{"layers": 22, "window": 512, "bytes_per_block": 202752}, ...]}
                                    a hybrid model's KV cache groups past the first, if any
    {"e": "arrive", "s": 0, "t": 0.0012, "r": "req-0", "p": 57, "n": 1, "h": ["1a2b3c4d", ...]}
    {"e": "hit", "s": 1, "t": 0.0101, "r": "req-0", "q": 0, "b": [3, 4], "c": 32}
    {"e": "alloc", "s": 1, "t": 0.0102, "r": "req-0", "q": 0, "b": [5, 6]}
    {"e": "step", "s": 1, "t": 0.0350, "u": 6, "c": 0, "f": 94, "o": 100}
    ...

Keys every event has: "e" the kind, "s" the engine step it happened in (the step about to run,
counting from 0 after the warm-up), "t" seconds since the header's time. The others, by kind:

    arrive   r request id, p prompt tokens, n completions, h short hashes of the prompt's full
             blocks (`kvpool.formats.snapshot_runs.short_hash`, chained: equal leading hashes
             mean an equal prefix)
    hit      r, q (completion index), b device blocks taken from the prefix cache, c prompt
             tokens served (all tiers), and "k": {"host": tokens, "disk": tokens, "shared":
             tokens} when a tier below served some
    alloc    r, q, b blocks newly taken by the sequence's table ("d": 1 when they are only
                     for speculative drafts' tentative slots)
    free     r, q, b blocks its table gave back (reference drops; shared blocks stay in use;
                     "d": 1 for blocks that held only rejected drafts)
    evict    b cached blocks the device evicted to make room, or an elastic shrink dropped
             (their prefixes are lost here)
    fork     r, q the new completion, "from" the completion it shares its blocks with, b blocks
    cow      r, q, "src" shared block, "dst" its private copy
    preempt  r, q, "m" "recompute" or "swap", b blocks it held
    swap_in  r, q, b new device blocks its host copies went back to (its leading blocks
             still cached on the device come back as a hit)
    spill    b device blocks copied to the host tier as they were evicted
    grow     "n" online device blocks after, "d" blocks added
    shrink   "n" online device blocks after, "d" blocks removed, and "m": [[old, new], ...]
             when used blocks were relocated (their references move from old to new)
    finish   r, "o" output tokens (the longest completion), "why" finish reason
    step     after each step: "u" used, "c" cached, "f" free, "o" online device blocks
    groups   after each step of a hybrid model: "p": [[u, c, f, o], ...], the same counts for
             each KV cache group past the first, in the header's order

A hybrid model's (`kvpool.memory.kv_groups`) block events name its first group's blocks, the
full-attention layers' (the other groups take and drop theirs with them, a sliding window's
fewer): replaying them is replaying that group's pool; "groups" shows the others.

Replaying references: hit, alloc, fork, swap_in and a cow's "dst" take one per block; free,
preempt and a cow's "src" drop one; a shrink's "m" moves them. The blocks with references
after a "step" event are exactly its "u"; after the last request finishes, none are left.
Events between steps (arrivals, aborts) carry the number of the step about to run; a
`reset_stats` of a traced engine starts the step numbers from 0 again.

Readers skip kinds they do not know, so later versions may add kinds without a version bump.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TRACE_FORMAT = "kvpool.kv_trace"
TRACE_VERSION = 1
EVENT_KINDS = ("arrive", "hit", "alloc", "free", "evict", "fork", "cow", "preempt", "swap_in",
               "spill", "grow", "shrink", "finish", "step", "groups")


@dataclass(frozen=True, slots=True)
class TraceHeader:
    time: float
    block_size: int
    num_blocks: int
    bytes_per_block: int
    kv_cache_dtype: str
    groups: tuple[dict[str, Any], ...] = ()  # KV cache groups past the first (module docstring)

    def to_json(self) -> dict[str, Any]:
        doc = {"format": TRACE_FORMAT, "version": TRACE_VERSION, "time": self.time,
               "block_size": self.block_size, "num_blocks": self.num_blocks,
               "bytes_per_block": self.bytes_per_block, "kv_cache_dtype": self.kv_cache_dtype}
        if self.groups:
            doc["groups"] = list(self.groups)
        return doc


@dataclass(frozen=True, slots=True)
class KVTrace:
    header: TraceHeader
    events: list[dict[str, Any]]  # in file order; each has "e", "s" and "t"

    def of_kind(self, *kinds: str) -> Iterator[dict[str, Any]]:
        return (event for event in self.events if event["e"] in kinds)


def is_kv_trace(path: str | Path) -> bool:
    """Whether the file's first line is a kvpool KV trace header."""
    with open(path, encoding="utf-8") as file:
        first = file.readline()
    try:
        return json.loads(first).get("format") == TRACE_FORMAT
    except (ValueError, AttributeError):
        return False


def read_kv_trace(path: str | Path) -> KVTrace:
    """The header and events of a trace file; ValueError naming the line of a bad one. A last
    line cut short (the engine was killed mid-write) is dropped, not an error."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    if not lines:
        raise ValueError(f"{path}: empty file, not a kvpool KV trace")
    header = _parse_header(path, lines[0])
    events = []
    for line_number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        try:
            event = json.loads(line)
        except ValueError:
            if line_number == len(lines):
                break  # torn last line
            raise ValueError(f"{path}:{line_number}: not JSON") from None
        if not isinstance(event, dict) or not {"e", "s", "t"} <= event.keys():
            raise ValueError(f"{path}:{line_number}: an event needs 'e', 's' and 't'")
        events.append(event)
    return KVTrace(header, events)


def _parse_header(path: str | Path, line: str) -> TraceHeader:
    try:
        doc = json.loads(line)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or doc.get("format") != TRACE_FORMAT:
        raise ValueError(f"{path}: not a kvpool KV trace (no {TRACE_FORMAT!r} header)")
    if doc.get("version") != TRACE_VERSION:
        raise ValueError(f"{path}: KV trace version {doc.get('version')!r} is not supported "
                         f"(this kvpool reads version {TRACE_VERSION})")
    try:
        return TraceHeader(float(doc["time"]), int(doc["block_size"]), int(doc["num_blocks"]),
                           int(doc["bytes_per_block"]), str(doc["kv_cache_dtype"]),
                           tuple(dict(group) for group in doc.get("groups", ())))
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: bad KV trace header ({error!r})") from None

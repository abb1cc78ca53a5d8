"""A `KVSnapshot` read out for a person: what the pool holds, who holds it, what is next to go.

`summary_json` computes every figure once, as plain data (the tests read it); `format_summary`
only lays that out as text. Nothing here needs the engine: a saved snapshot is enough.

What the figures mean:
- "cached" blocks are not leaked: they hold no reference, count as allocatable memory and keep
  a prefix that a later prompt may reuse; the pool evicts them, least recently used first, only
  when no free block is left.
- A request's share of the pool counts a block held by k sequences as 1/k to each holder, so
  the shares add up to the used blocks; "held" counts every block a request's tables list.
- Leased blocks (a kv_producer's) are used blocks a live lease keeps for a decode worker that
  has yet to read them; with no sequence holding them they are no request's, and not leaked.
- Shared blocks are grouped by the exact set of sequences holding them, with their positions
  in the first holder's table (positions 0..n-1 are a shared prefix). Cached prefix chains
  cannot be recovered: a snapshot keeps a short hash per block but no parent link.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from dataclasses import asdict
from typing import Any

from kvpool.formats.kv_snapshot import (
    BLOCK_STATES,
    CACHED,
    OFFLINE,
    USED,
    KVSnapshot,
    PoolView,
    SequenceView,
)

ONLINE_STATES = tuple(state for state in BLOCK_STATES if state != OFFLINE)


def summary_json(snapshot: KVSnapshot, top: int = 5) -> dict[str, Any]:
    """Every figure of the summary as plain data (`top`: rows per ranked list)."""
    return {
        "time": snapshot.time, "step": snapshot.step, "version": snapshot.version,
        "pools": {name: _pool_figures(view) for name, view in snapshot.pools.items()},
        "derived": asdict(snapshot.derived),
        "holders": _holders(snapshot)[:top],
        "shared": _shared_groups(snapshot)[:top],
        "oldest_cached": _oldest_cached(snapshot.device, top),
        "disk": snapshot.disk,
        "num_recent_evictions": len(snapshot.recent_evictions),
        "num_sequences": len(snapshot.sequences),
    }


def format_summary(snapshot: KVSnapshot, top: int = 5) -> str:
    """The readable report (module docstring)."""
    figures = summary_json(snapshot, top)
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(figures["time"]))
    lines = [f"KV snapshot at {when}, engine step {figures['step']}, "
             f"{figures['num_sequences']} live sequence(s)"]
    for name, pool in figures["pools"].items():
        lines += _pool_lines("device pool" if name == "device" else f"{name} tier", pool)
    lines += _derived_lines(figures["derived"])
    lines += _holder_lines(figures["holders"])
    lines += _shared_lines(figures["shared"])
    lines += _oldest_lines(figures["oldest_cached"])
    if figures["disk"] is not None:
        disk = figures["disk"]
        lines.append(f"disk tier: {disk['num_blocks']} blocks, {format_bytes(disk['num_bytes'])}")
    lines.append(f"recent evictions remembered: {figures['num_recent_evictions']}")
    return "\n".join(lines)


def format_bytes(num_bytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num_bytes) < 1024 or unit == "GiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


# ------------------------------------------------------------------- figures
def _pool_figures(view: PoolView) -> dict[str, Any]:
    counts = {state: view.count(state) for state in BLOCK_STATES}
    online = view.num_blocks
    return {
        "num_blocks": online, "capacity_blocks": view.capacity_blocks,
        "block_size": view.block_size, "bytes_per_block": view.bytes_per_block,
        "kv_cache_dtype": view.kv_cache_dtype, "counts": counts,
        "fractions": {state: counts[state] / online if online else 0.0
                      for state in ONLINE_STATES},
        "bytes": {state: counts[state] * view.bytes_per_block for state in ONLINE_STATES},
    }


def _seq_name(seq: SequenceView) -> str:
    return f"{seq.request_id}#{seq.index}"


def _holders(snapshot: KVSnapshot) -> list[dict[str, Any]]:
    """Requests by their share of the device's used blocks, largest first."""
    share: dict[int, float] = defaultdict(float)
    held: dict[int, int] = defaultdict(int)
    for run in snapshot.device.runs:
        if run.state != USED or not run.holders:
            continue
        k = max(run.ref_count, len(run.holders))  # a tenant's view may list fewer holders
        for holder in run.holders:
            share[holder] += run.count / k
            held[holder] += run.count
    by_request: dict[str, dict[str, Any]] = {}
    for index, seq in enumerate(snapshot.sequences):
        row = by_request.setdefault(seq.request_id, {
            "request_id": seq.request_id, "num_sequences": 0, "statuses": {},
            "num_tokens": 0, "num_blocks_share": 0.0, "num_blocks_held": 0,
            "tenant": seq.tenant})
        row["num_sequences"] += 1
        row["statuses"][seq.status] = row["statuses"].get(seq.status, 0) + 1
        row["num_tokens"] += seq.num_tokens
        row["num_blocks_share"] += share[index]
        row["num_blocks_held"] += held[index]
    return sorted(by_request.values(), key=lambda row: (-row["num_blocks_share"],
                                                        -row["num_blocks_held"]))


def _shared_groups(snapshot: KVSnapshot) -> list[dict[str, Any]]:
    """Used blocks held by several sequences, grouped by their exact holders, largest first."""
    groups: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for run in snapshot.device.runs:
        if run.state == USED and run.ref_count > 1 and len(run.holders) > 1:
            groups[run.holders].extend(run.block_ids)
    rows = []
    for holders, block_ids in groups.items():
        table = snapshot.sequences[holders[0]].block_ids
        members = set(block_ids)
        positions = [position for position, block_id in enumerate(table) if block_id in members]
        rows.append({
            "num_blocks": len(block_ids),
            "sequences": [_seq_name(snapshot.sequences[h]) for h in holders],
            "positions": [positions[0], positions[-1]] if positions else None,
            "is_prefix": positions == list(range(len(positions))),
        })
    return sorted(rows, key=lambda row: (-row["num_blocks"], -len(row["sequences"])))


def _oldest_cached(view: PoolView, top: int) -> list[dict[str, Any]]:
    """The LRU head: the cached blocks evicted next, with how long each has been idle."""
    firsts = [first for first, _, _ in view.ages]
    rows = []
    for block_id in view.lru[:top]:
        at = bisect.bisect_right(firsts, block_id) - 1
        age = None
        if at >= 0:
            first, count, run_age = view.ages[at]
            age = run_age if block_id < first + count else None
        rows.append({"block_id": block_id, "short_hash": view.hashes.get(block_id),
                     "age_s": age})
    return rows


# --------------------------------------------------------------------- lines
def _pool_lines(title: str, pool: dict[str, Any]) -> list[str]:
    total = pool["num_blocks"] * pool["bytes_per_block"]
    lines = [f"{title}: {pool['num_blocks']} blocks x {pool['block_size']} tokens, "
             f"{pool['kv_cache_dtype']}, {format_bytes(pool['bytes_per_block'])}/block, "
             f"{format_bytes(total)} online"]
    notes = {CACHED: "  reusable prefixes, not leaked: evicted LRU only when nothing is free",
             "other": "  used by other tenants' sequences"}
    for state in ONLINE_STATES:
        count = pool["counts"][state]
        if state == "other" and not count:
            continue
        lines.append(f"  {state:<8}{count:>8}  {pool['fractions'][state]:6.1%}  "
                     f"{format_bytes(pool['bytes'][state]):>10}{notes.get(state, '')}")
    lines.append(f"  {OFFLINE:<8}{pool['counts'][OFFLINE]:>8}  id(s) with no memory behind "
                 "them (the null block included)")
    return lines


def _derived_lines(derived: dict[str, Any]) -> list[str]:
    window = derived["rate_window_s"]
    rates = (f"allocations {derived['alloc_rate']:.1f}/s, frees {derived['free_rate']:.1f}/s "
             f"over the last {window:.1f} s" if window else "no rates yet (no step taken)")
    lines = [
        f"figures: internal fragmentation {derived['internal_fragmentation']:.1%} (empty slots "
        f"in used blocks); free list {derived['free_list_size']} blocks; {rates}",
        f"         cached {derived['cached_fraction']:.1%} of blocks; shared "
        f"{derived['shared_fraction']:.1%} of used blocks ({derived['num_shared_blocks']})",
    ]
    if derived["num_leased_blocks"]:
        lines.append(f"         leased {derived['num_leased_blocks']} blocks, kept for decode "
                     "workers to read (KV transfer)")
    return lines


def _holder_lines(holders: list[dict[str, Any]]) -> list[str]:
    if not holders:
        return ["top holders: none (no live sequence)"]
    lines = ["top holders (a block shared by k sequences counts 1/k to each):"]
    for row in holders:
        statuses = ", ".join(f"{n} {status}" for status, n in sorted(row["statuses"].items()))
        tenant = f"  tenant {row['tenant']}" if row["tenant"] else ""
        lines.append(f"  {row['request_id']:<16} {row['num_blocks_share']:8.1f} blocks "
                     f"({row['num_blocks_held']} held)  {row['num_sequences']} seq(s): "
                     f"{statuses}  {row['num_tokens']} tokens{tenant}")
    return lines


def _shared_lines(groups: list[dict[str, Any]]) -> list[str]:
    if not groups:
        return ["shared blocks: none"]
    lines = ["largest shared blocks (by the sequences holding them):"]
    for row in groups:
        where = ""
        if row["positions"] is not None:
            first, last = row["positions"]
            kind = "a shared prefix" if row["is_prefix"] else "table positions"
            where = f" ({kind} {first}-{last} of {row['sequences'][0]})"
        lines.append(f"  {row['num_blocks']} block(s){where} held by "
                     f"{', '.join(row['sequences'])}")
    return lines


def _oldest_lines(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return ["oldest cached blocks: none cached"]
    lines = ["oldest cached blocks (the LRU head: evicted first when nothing is free):"]
    for row in rows:
        age = "never used" if row["age_s"] is None else f"idle {row['age_s']:.1f} s"
        lines.append(f"  block {row['block_id']:<8} {row['short_hash'] or '-':<10} {age}")
    return lines

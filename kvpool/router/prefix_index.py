"""`PrefixIndex`: which block hashes one replica holds, in which tiers, as its KV events tell.

    _mediums_by_hash   block hash -> bit set of the mediums holding it ("device", "host", ...)
    _bit_by_medium     medium -> its bit (a new medium name gets the next bit)

The subscriber's thread writes (`apply`, `replace`, `clear`); the router's event loop reads
(`longest_prefix`, `len`); one lock makes every call atomic, so a reader sees the index before
or after a whole batch, never half of one.

Invariants:
- Every value in `_mediums_by_hash` is non-zero: a hash is a key iff at least one medium
  holds it, so `len` counts each held block once, whatever the number of its tiers.
- A hash's bit for medium m is set iff, of the events for (hash, m) since the last `replace`
  or `clear` (or AllBlocksCleared), the last was a BlockStored (or the snapshot listed it).

Block hashes chain (`kvpool.memory.prefix_cache`), so a held hash means the replica computed
its whole prefix once; `longest_prefix` still stops at the first hash not held, since the
earlier blocks may have been evicted since.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from kvpool.formats.kv_events import DEVICE, AllBlocksCleared, BlockStored, KVEventBatch
from kvpool.formats.kv_media import split_medium


class PrefixIndex:
    """Block hash -> the tiers holding it, for one replica (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._mediums_by_hash: dict[bytes, int] = {}
        self._bit_by_medium: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._mediums_by_hash)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._mediums_by_hash

    def longest_prefix(self, block_hashes: Sequence[bytes]) -> int:
        """How many leading `block_hashes` some tier holds (stops at the first missing)."""
        with self._lock:
            held = self._mediums_by_hash
            for count, block_hash in enumerate(block_hashes):
                if block_hash not in held:
                    return count
            return len(block_hashes)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply a batch's events in order (a medium of None counts as the device); a hybrid
        model's KV cache groups past the first are left out (`split_medium`): the first
        group's blocks, which a hit needs all of, decide."""
        with self._lock:
            held = self._mediums_by_hash
            for event in batch.events:
                if type(event) is AllBlocksCleared:
                    held.clear()
                    continue
                if event.medium and split_medium(event.medium)[1]:
                    continue
                bit = self._bit(event.medium or DEVICE)
                if type(event) is BlockStored:
                    for block_hash in event.block_hashes:
                        held[block_hash] = held.get(block_hash, 0) | bit
                    continue
                for block_hash in event.block_hashes:  # BlockRemoved
                    remaining = held.get(block_hash, 0) & ~bit
                    if remaining:
                        held[block_hash] = remaining
                    else:
                        held.pop(block_hash, None)

    def replace(self, blocks: Iterable[tuple[bytes, str]]) -> None:
        """Hold exactly `blocks`, (hash, medium) pairs (a snapshot's), and nothing else."""
        with self._lock:
            held: dict[bytes, int] = {}
            for block_hash, medium in blocks:
                if medium and split_medium(medium)[1]:
                    continue
                held[block_hash] = held.get(block_hash, 0) | self._bit(medium or DEVICE)
            self._mediums_by_hash = held

    def clear(self) -> None:
        with self._lock:
            self._mediums_by_hash = {}

    def blocks(self) -> set[tuple[bytes, str]]:
        """Every (hash, medium) held, as a snapshot lists them (O(len); for checks)."""
        with self._lock:
            return {(block_hash, medium) for block_hash, bits in self._mediums_by_hash.items()
                    for medium, bit in self._bit_by_medium.items() if bits & bit}

    def _bit(self, medium: str) -> int:
        bit = self._bit_by_medium.get(medium)
        if bit is None:
            bit = self._bit_by_medium[medium] = 1 << len(self._bit_by_medium)
        return bit

"""A prefix's blocks found below the device pool: where each one is, and how they are found.

A lookup that ends on the device walks on (`TierLookup.find`), block by block while the hash
chain holds, taking each block from the first tier that has it:

    host     the host tier's prefix cache (an index lookup; the token ids are compared)
    disk     the disk tier's index (no I/O)
    shared   Redis (`kvpool.memory.redis_tier`): asked once per lookup, for every block from
             the first that neither host nor disk has (memo, else one pipelined EXISTS)

Only once the admission is known to fit does `TierLookup.validate` read the disk and shared
blocks (disk files one by one, shared values in ONE MGET) and check them, token ids included;
the match ends before the first block that fails, so what is served is a chain of validated
blocks. A waiting sequence re-planned every step therefore never reads a block's bytes twice.

A match's sources, in prefix order: a host block id (`int`), a `StoredRef` (a disk or shared
block not yet read), or a `LoadedBlock` (read and validated; its tensors are the caller's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.memory.disk_block_format import StoredBlock
from kvpool.memory.disk_tier import DiskKVTier
from kvpool.memory.host_tier import HostKVTier
from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.redis_tier import RedisKVTier

DISK, SHARED = "disk", "shared"


@dataclass(frozen=True, slots=True)
class StoredRef:
    """A block found in a stored tier ("disk" or "shared"), not yet read."""

    tier: str
    block_hash: BlockHash


@dataclass(frozen=True, slots=True)
class LoadedBlock:
    """A stored tier's block, read and validated."""

    tier: str
    block: StoredBlock


@dataclass(slots=True)
class TierMatch:
    """Blocks of a prefix found below the device, in order (module docstring)."""

    sources: list[int | StoredRef | LoadedBlock] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        return len(self.sources)


class TierLookup:
    """The walk below the device: host, then disk, then shared, block by block."""

    def __init__(self, block_size: int, host: HostKVTier | None, disk: DiskKVTier | None,
                 shared: RedisKVTier | None) -> None:
        self.block_size = block_size
        self.host_cache = host.pool.prefix_cache if host is not None else None
        self.disk = disk
        self.shared = shared

    def find(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
             first_block: int, num_blocks: int) -> TierMatch:
        """Blocks `first_block .. num_blocks - 1` of a prefix found below the device while the
        chain holds; nothing is read or taken (at most one round trip to Redis)."""
        match = TierMatch()
        in_shared: list[bool] | None = None  # from `first_shared` on, asked once
        first_shared = first_block
        for index in range(first_block, num_blocks):
            source = self._host_or_disk(block_hashes[index], self._tokens(token_ids, index))
            if source is None and self.shared is not None:
                if in_shared is None:
                    first_shared = index
                    in_shared = self.shared.find(block_hashes[index:num_blocks])
                if in_shared[index - first_shared]:
                    source = StoredRef(SHARED, block_hashes[index])
            if source is None:
                break
            match.sources.append(source)
        return match

    def validate(self, match: TierMatch, token_ids: Sequence[int], first_block: int) -> None:
        """Read and check the match's disk and shared blocks; the match ends before the first
        that fails."""
        sources = match.sources
        for offset, source in enumerate(sources):
            if isinstance(source, StoredRef) and source.tier == DISK:
                block = self.disk.load(source.block_hash,
                                       self._tokens(token_ids, first_block + offset))
                if block is None:
                    del sources[offset:]
                    break
                sources[offset] = LoadedBlock(DISK, block)
        offsets = [offset for offset, source in enumerate(sources)
                   if isinstance(source, StoredRef)]  # the shared ones: disk's are read
        if not offsets:
            return
        blocks = self.shared.load_run(
            [sources[offset].block_hash for offset in offsets],
            [self._tokens(token_ids, first_block + offset) for offset in offsets])
        for offset, block in zip(offsets, blocks, strict=False):
            sources[offset] = LoadedBlock(SHARED, block)
        if len(blocks) < len(offsets):
            del sources[offsets[len(blocks)]:]

    def _host_or_disk(self, block_hash: BlockHash, tokens: Sequence[int]) -> int | StoredRef | None:
        if self.host_cache is not None:
            host_id = self.host_cache.lookup(block_hash, tokens)
            if host_id is not None:
                return host_id
        if self.disk is not None and self.disk.contains(block_hash):
            return StoredRef(DISK, block_hash)
        return None

    def _tokens(self, token_ids: Sequence[int], index: int) -> Sequence[int]:
        return token_ids[index * self.block_size:(index + 1) * self.block_size]

"""A prefix's blocks found below the device pool: where each one is, and how they are found.

A lookup that ends on the device walks on (`TierLookup.find`), block by block while the hash
chain holds, taking each block from the first tier of the ordered list that has it
(`LowerTier.start_lookup`; `kvpool.memory.tiers.lower_tier`):

    host     the host tier's prefix cache (an index lookup; the token ids are compared)
    disk     the disk tier's index (no I/O)
    shared   Redis (`kvpool.memory.tiers.redis_tier`): asked once per lookup, for every block
             from the first that neither host nor disk has (memo, else one pipelined EXISTS)

Only once the admission is known to fit does `TierLookup.validate` read the stored blocks, one
tier at a time in list order (`LowerTier.load_run`: disk files one by one, shared values in ONE
MGET) and check them, token ids included; the match ends before the first block that fails, so
what is served is a chain of validated blocks. A waiting sequence re-planned every step
therefore never reads a block's bytes twice.

A match's sources, in prefix order: a host block id (`int`), a `StoredRef` (a disk or shared
block not yet read), or a `LoadedBlock` (read and validated; its tensors are the caller's).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.tiers.disk_block_format import StoredBlock
from kvpool.memory.tiers.lower_tier import DISK, SHARED, LowerTier, StoredRef

__all__ = ["DISK", "SHARED", "LoadedBlock", "StoredRef", "TierLookup", "TierMatch"]


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
    """The walk below the device: the tiers in list order, block by block."""

    def __init__(self, block_size: int, tiers: Sequence[LowerTier]) -> None:
        self.block_size = block_size
        self.tiers = tiers

    def find(self, block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
             first_block: int, num_blocks: int) -> TierMatch:
        """Blocks `first_block .. num_blocks - 1` of a prefix found below the device while the
        chain holds; nothing is read or taken (at most one round trip to Redis)."""
        match = TierMatch()
        finders = [tier.start_lookup(block_hashes, num_blocks) for tier in self.tiers]
        for index in range(first_block, num_blocks):
            tokens = self._tokens(token_ids, index)
            source = next((found for find in finders
                           if (found := find(index, tokens)) is not None), None)
            if source is None:
                break
            match.sources.append(source)
        return match

    def validate(self, match: TierMatch, token_ids: Sequence[int], first_block: int) -> None:
        """Read and check the match's stored blocks, tier by tier; the match ends before the
        first that fails."""
        sources = match.sources
        for tier in self.tiers:
            offsets = [offset for offset, source in enumerate(sources)
                       if isinstance(source, StoredRef) and source.tier == tier.name]
            if not offsets:
                continue
            blocks = tier.load_run(
                [sources[offset].block_hash for offset in offsets],
                [self._tokens(token_ids, first_block + offset) for offset in offsets])
            for offset, block in zip(offsets, blocks, strict=False):
                sources[offset] = LoadedBlock(tier.name, block)
            if len(blocks) < len(offsets):
                del sources[offsets[len(blocks)]:]

    def _tokens(self, token_ids: Sequence[int], index: int) -> Sequence[int]:
        return token_ids[index * self.block_size:(index + 1) * self.block_size]

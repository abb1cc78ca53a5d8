"""The one interface of a tier below the device pool (`LowerTier`): what the tier walk, the
write-through, statistics, snapshots and invariant checks ask of it.

`KVTiers` holds its tiers as an ordered list, nearest first (host, disk, shared), and every
walk over them is one loop over that list: the prefix lookup (`kvpool.memory.tiers.tier_match`),
the write-through after a step, `stats`, `check_invariants`, the KV snapshot and the prefix
explainer (`holds`). A new tier implements this class and takes its place in the list.

A lookup asks each tier in turn for the next block of a prefix (`start_lookup` gives a
`BlockFinder` for one lookup, so a remote tier can ask for the rest of the run in one round
trip, once); a block found is a host block id (`int`) or a `StoredRef` that `load_run` reads
and validates once the admission is known to fit.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool.memory.prefix_cache import BlockHash

if TYPE_CHECKING:
    import torch

    from kvpool.memory.block_pool import BlockPool
    from kvpool.memory.tiers.disk_block_format import StoredBlock

HOST, DISK, SHARED = "host", "disk", "shared"


@dataclass(frozen=True, slots=True)
class StoredRef:
    """A block found in a stored tier ("disk" or "shared"), not yet read."""

    tier: str
    block_hash: BlockHash


# (block index in the prefix, its token ids) -> where the tier has it, or None.
BlockFinder = Callable[[int, Sequence[int]], "int | StoredRef | None"]


class LowerTier(ABC):
    """A tier below the device pool. Every tier implements the lookup, its statistics and its
    invariants; the other defaults suit a tier that is not written through and keeps nothing
    to read (the host tier; disk and shared override them)."""

    name: str
    pool: BlockPool | None = None  # a tier of KV blocks in memory (the host) has a block pool

    @abstractmethod
    def start_lookup(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> BlockFinder:
        """A finder for one prefix lookup over `block_hashes[:num_blocks]`; nothing is read
        or taken."""

    def holds(self, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Whether the tier's own index holds this block (no I/O; a remote tier says False)."""
        return False

    def load_run(self, block_hashes: Sequence[BlockHash],
                 token_ids: Sequence[Sequence[int]]) -> list[StoredBlock]:
        """The leading blocks read and validated (the run ends before the first that fails)."""
        return []

    def wanted(self, block_hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """Those of `block_hashes` a write-through should hand to `store` (none: the tier is
        not written through)."""
        return set()

    def store(self, block_hash: BlockHash, token_ids: Sequence[int], kv: torch.Tensor,
              scales: torch.Tensor | None, ready: Any = None) -> None:
        """Queue one full block for writing (only blocks `wanted` named are handed over; a
        tier that wants none is never handed one)."""
        raise AssertionError(f"the {self.name} tier is not written through")

    def summary(self) -> dict[str, int]:
        """What a KV snapshot shows of a tier without a block pool."""
        return {}

    @abstractmethod
    def stats(self) -> Any:
        """The tier's counters and sizes (its own stats record)."""

    def flush(self) -> None:
        """Wait for the tier's queued writes (before its invariants are checked)."""
        return None

    def close(self) -> None:
        """Finish the tier's writes (idempotent)."""
        return None

    def reset(self) -> None:
        """Drop what the tier keeps for this process only (the host's spilled blocks; with no
        block used); a persistent tier (disk, Redis) keeps everything: surviving is its point."""
        return None

    @abstractmethod
    def check_invariants(self) -> None:
        """Assert the tier's invariants (for tests)."""

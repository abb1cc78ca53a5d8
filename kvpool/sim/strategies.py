"""The interface every allocation strategy of the simulator implements, and the records they
share (`SimConfig`, `MemorySnapshot`, `ArenaActivity`); the strategies themselves live in
`contiguous` and `paged`, and the roster that builds them in `roster`.

Every strategy manages the same KV budget for the same model shape and is driven the same way
by `simulate` (FCFS admission, one token per running sequence per step). What differs is what
a sequence holds:

    contiguous-max      one range of max_seq_len tokens per sequence (static KV caches)
    contiguous-pow2     one range of the final length rounded up to a power of two
    contiguous-exact-*  one range of exactly the final length (Orca-like, needs an oracle),
                        placed first / best / worst fit on the engine's `Arena`
    contiguous-classes  the exact length rounded up to a size class (256 KiB, 1 MiB, 4 MiB,
                        16 MiB, then 2 MiB granules), freed ranges reused from class caches
    contiguous-exact-compact
                        exact ranges; an admission that fails on fragmentation compacts the
                        arena first (moving running sequences' KV; the bytes moved are counted)
    paged-B             blocks of B tokens taken as the sequence grows (the real `BlockPool`
                        and `SequenceBlocks`)
    paged-B+prefix      ... and full blocks of a shared system prompt reused across requests
    paged-B+fork        ... and the n samples of a request forked from one prompt (copy-on-write)

Memory is split four ways, always summing to the budget:

    token_states   KV of tokens the running sequences hold now
    reservation    reserved for tokens a running sequence will still generate
    internal       reserved but never to hold a token: past the final length, unfilled slots of
                   a sequence's last block, rounding
    free           held by no running sequence

Strategies over the simulator's `SizeClassArena` also report `ArenaActivity` (class-cache
hits, compactions, bytes moved); `simulate` asks for it where `ReportsArenaActivity` holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kvpool.memory.arena import BASE_ALIGNMENT
from kvpool.sim.model_shape import KVShape
from kvpool.sim.trace import Request

ALIGNMENT = BASE_ALIGNMENT  # budgets are whole multiples of the arena's base alignment


@dataclass(frozen=True, slots=True)
class SimConfig:
    """The memory setup every strategy shares."""

    budget_bytes: int
    shape: KVShape
    max_seq_len: int = 2048
    num_samples: int = 1  # parallel sampling: sequences per request

    def __post_init__(self) -> None:
        if self.budget_bytes <= 0 or self.budget_bytes % ALIGNMENT:
            raise ValueError(f"budget must be a positive multiple of {ALIGNMENT} bytes, "
                             f"got {self.budget_bytes}")
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be >= 2, got {self.max_seq_len}")
        if not 1 <= self.num_samples <= 64:
            raise ValueError(f"num_samples must be in 1..64, got {self.num_samples}")

    @property
    def budget_tokens(self) -> int:
        return self.budget_bytes // self.shape.bytes_per_token


@dataclass(frozen=True, slots=True)
class MemorySnapshot:
    """Where the budget is at one step, in bytes (see the module docstring)."""

    token_states: int
    reservation: int
    internal: int
    free: int
    external_fragmentation: float  # 1 - largest free range / free; 0 when any free byte serves


@dataclass(frozen=True, slots=True)
class ArenaActivity:
    """What an arena that caches and compacts did over a run."""

    num_cache_hits: int = 0  # allocations served from a size-class cache
    num_compactions: int = 0
    num_bytes_moved: int = 0  # KV bytes copied by compactions


@runtime_checkable
class ReportsArenaActivity(Protocol):
    """A strategy whose arena caches or moves ranges (the others report nothing)."""

    def arena_activity(self) -> ArenaActivity: ...


class Strategy(Protocol):
    """What `simulate` needs from an allocation strategy."""

    name: str
    block_size: int | None

    def try_admit(self, request: Request, num_generated: int) -> bool:
        """Store the prompt plus `num_generated` tokens for each sample; False if it won't fit."""
        ...

    def try_grow(self, request: Request) -> bool:
        """Store one more token for each sample; False (nothing changed) if memory ran out."""
        ...

    def release(self, request: Request) -> None:
        """Give back everything the request holds."""
        ...

    def memory(self) -> MemorySnapshot: ...

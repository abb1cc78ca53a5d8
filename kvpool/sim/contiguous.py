"""Contiguous strategies: each sequence reserves one range of an arena at admission.

The arena's buffer lives on the `meta` device, so a budget of gigabytes costs no memory: only
the arena's bookkeeping (placement, splitting, coalescing, statistics) runs. A reservation
never grows, so `try_grow` always succeeds. Three arenas:

    ContiguousStrategy   the engine's `Arena`: exact ranges, never moved, as in systems that
                         cannot move a running sequence's KV (contiguous-max / -pow2 / -exact-*)
    SizeClassStrategy    the simulator's `SizeClassArena`: each range rounded up to a size
                         class, freed ranges parked in class caches and reused
                         (contiguous-classes)
    CompactingStrategy   the same arena, exact relocatable ranges: an admission that fails
                         although the free total would hold it compacts the arena first,
                         moving running sequences' KV (contiguous-exact-compact)

Rounding to a class or to the 256-byte base alignment counts as internal fragmentation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvpool.memory.arena import (
    Arena,
    ArenaConfig,
    ArenaHandle,
    ArenaOutOfMemoryError,
    PlacementPolicy,
)
from kvpool.sim.size_class_arena import SizeClassArena, SizeClasses
from kvpool.sim.strategies import ArenaActivity, MemorySnapshot, SimConfig
from kvpool.sim.trace import Request

if TYPE_CHECKING:
    import torch

ReserveLen = Callable[[Request, int], int]  # (request, max_seq_len) -> tokens to reserve


def reserve_max(request: Request, max_seq_len: int) -> int:
    """Static KV caches: every sequence may grow to the model's maximum length."""
    return max_seq_len


def reserve_pow2(request: Request, max_seq_len: int) -> int:
    """The final length rounded up to a power of two (at most max_seq_len)."""
    return min(max_seq_len, 1 << (request.final_len - 1).bit_length())


def reserve_exact(request: Request, max_seq_len: int) -> int:
    """Exactly the final length: an oracle that knows how long the output will be."""
    return request.final_len


@dataclass(slots=True)
class _Reservation:
    handles: list[ArenaHandle]
    num_tokens: int  # per sample
    reserved_len: int  # per sample


class ContiguousStrategy:
    """One exact range of the engine's `Arena` per sequence, sized by `reserve_len` at
    admission. Subclasses choose the arena (`_make_arena`) and the request (`_allocate`)."""

    block_size: int | None = None

    def __init__(self, config: SimConfig, name: str, reserve_len: ReserveLen,
                 policy: PlacementPolicy = PlacementPolicy.BEST_FIT) -> None:
        import torch

        self.name = name
        self.config = config
        self._reserve_len = reserve_len
        self._bytes_per_token = config.shape.bytes_per_token
        buffer = torch.empty(config.budget_bytes, dtype=torch.uint8, device="meta")
        self.arena = self._make_arena(buffer, ArenaConfig(policy=policy))
        self._reservations: dict[int, _Reservation] = {}
        self._num_token_states = 0  # summed over running sequences, in tokens
        self._num_final = 0
        self._num_reserved = 0

    def try_admit(self, request: Request, num_generated: int) -> bool:
        reserved_len = self._reserve_len(request, self.config.max_seq_len)
        assert request.final_len <= reserved_len
        handles: list[ArenaHandle] = []
        try:
            for _ in range(self.config.num_samples):
                handles.append(self._allocate(reserved_len * self._bytes_per_token))
        except ArenaOutOfMemoryError:
            for handle in handles:
                self.arena.free(handle)
            return False
        num_tokens = request.prompt_len + num_generated
        self._reservations[request.request_id] = _Reservation(handles, num_tokens, reserved_len)
        num_samples = self.config.num_samples
        self._num_token_states += num_samples * num_tokens
        self._num_final += num_samples * request.final_len
        self._num_reserved += num_samples * reserved_len
        return True

    def _make_arena(self, buffer: torch.Tensor, arena_config: ArenaConfig) -> Arena:
        return Arena(buffer, arena_config)

    def _allocate(self, nbytes: int) -> ArenaHandle:
        return self.arena.allocate(nbytes)

    def try_grow(self, request: Request) -> bool:
        self._reservations[request.request_id].num_tokens += 1
        self._num_token_states += self.config.num_samples
        return True

    def release(self, request: Request) -> None:
        reservation = self._reservations.pop(request.request_id)
        for handle in reservation.handles:
            self.arena.free(handle)
        num_samples = self.config.num_samples
        self._num_token_states -= num_samples * reservation.num_tokens
        self._num_final -= num_samples * request.final_len
        self._num_reserved -= num_samples * reservation.reserved_len

    def memory(self) -> MemorySnapshot:
        stats = self.arena.stats()
        per_token = self._bytes_per_token
        return MemorySnapshot(
            token_states=self._num_token_states * per_token,
            reservation=(self._num_final - self._num_token_states) * per_token,
            internal=(self._num_reserved - self._num_final) * per_token
            + stats.num_internal_waste_bytes,
            free=stats.num_free_bytes,
            external_fragmentation=stats.external_fragmentation,
        )


class SizeClassStrategy(ContiguousStrategy):
    """`contiguous-classes`: each range rounded up to a size class of `SizeClassArena`; a freed
    range waits in its class's cache for the next sequence of that class."""

    arena: SizeClassArena

    def __init__(self, config: SimConfig, name: str, reserve_len: ReserveLen,
                 policy: PlacementPolicy = PlacementPolicy.BEST_FIT,
                 classes: SizeClasses | None = None) -> None:
        self.classes = classes or SizeClasses()  # the seed's classes unless a test asks
        super().__init__(config, name, reserve_len, policy)

    def _make_arena(self, buffer: torch.Tensor, arena_config: ArenaConfig) -> Arena:
        return SizeClassArena(buffer, arena_config, self.classes)

    def arena_activity(self) -> ArenaActivity:
        stats = self.arena.class_stats()
        return ArenaActivity(sum(stats.cache_hits.values()), stats.num_compactions,
                             stats.num_bytes_moved)


class CompactingStrategy(SizeClassStrategy):
    """`contiguous-exact-compact`: exact, relocatable ranges; an admission that fails on
    fragmentation alone compacts the arena (moving running sequences) and retries."""

    def _allocate(self, nbytes: int) -> ArenaHandle:
        return self.arena.allocate(nbytes, size_class=False, relocatable=True)

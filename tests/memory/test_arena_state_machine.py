"""Property test: random allocate / free sequences on a small engine arena, under every
placement policy and with block-like alignments, conserve bytes, never overlap, keep every
offset aligned, fail only when no free range could hold the request, and give everything back
at quiescence."""

from __future__ import annotations

import math

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.memory.arena import (
    Arena,
    ArenaConfig,
    ArenaHandle,
    ArenaOutOfMemoryError,
    PlacementPolicy,
)
from tests.memory.arena_checks import assert_arena_empty, assert_no_free_range_fits, write_pattern

ARENA_NBYTES = 16384


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.arena: Arena
        self.live: list[ArenaHandle] = []
        self.expected: dict[int, torch.Tensor] = {}  # id(handle) -> bytes it wrote
        self.requested: dict[int, int | None] = {}  # id(handle) -> alignment it asked for
        self.num_allocations = 0
        self.next_seed = 0

    @initialize(policy=st.sampled_from(list(PlacementPolicy)))
    def make_arena(self, policy: PlacementPolicy) -> None:
        buffer = torch.zeros(ARENA_NBYTES, dtype=torch.uint8)
        self.arena = Arena(buffer, ArenaConfig(policy=policy))

    def _bytes(self, handle: ArenaHandle) -> torch.Tensor:
        return self.arena.buffer[handle.offset : handle.offset + handle.nbytes]

    @rule(nbytes=st.integers(1, 5000), alignment=st.sampled_from([None, 512, 768, 1024, 1000]))
    def allocate(self, nbytes: int, alignment: int | None) -> None:
        try:
            handle = self.arena.allocate(nbytes, alignment=alignment)
        except ArenaOutOfMemoryError as error:
            assert_no_free_range_fits(self.arena, error, alignment)
            event("allocation failed")
            return
        self.num_allocations += 1
        self.next_seed += 1
        self.live.append(handle)
        self.expected[id(handle)] = write_pattern(self._bytes(handle), self.next_seed)
        self.requested[id(handle)] = alignment

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 10**6))
    def free(self, index: int) -> None:
        handle = self.live.pop(index % len(self.live))
        self.arena.free(handle)
        assert not handle.is_live
        del self.expected[id(handle)], self.requested[id(handle)]

    @invariant()
    def arena_invariants_hold(self) -> None:
        # Ranges tile the arena without overlap (bytes are conserved), free neighbours are
        # coalesced, every live offset is aligned.
        self.arena.check_invariants()
        stats = self.arena.stats()
        assert stats.num_live_allocations == len(self.live)
        assert stats.num_allocated_bytes == sum(h.nbytes for h in self.live)
        assert stats.num_allocations - stats.num_frees == len(self.live)

    @invariant()
    def handles_keep_their_bytes(self) -> None:
        for handle in self.live:
            assert handle.offset % handle.alignment == 0
            assert handle.alignment == math.lcm(self.requested[id(handle)] or 1, 256)
            assert torch.equal(self._bytes(handle), self.expected[id(handle)])

    def teardown(self) -> None:
        if not hasattr(self, "arena"):
            return
        for handle in self.live:
            self.arena.free(handle)
        self.live.clear()
        assert_arena_empty(self.arena, ARENA_NBYTES)
        stats = self.arena.stats()
        assert stats.num_allocations == stats.num_frees == self.num_allocations


ArenaMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestArenaStateMachine = ArenaMachine.TestCase

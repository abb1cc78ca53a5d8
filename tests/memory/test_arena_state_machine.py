"""Property test: random allocate / free / compact / flush sequences on a small arena, under
every placement policy, keep the arena's invariants and every allocation's data."""

from __future__ import annotations

import math

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.memory.arena import Arena, ArenaHandle
from kvpool.memory.arena_free_list import PlacementPolicy, align_up
from kvpool.memory.arena_policy import ArenaConfig
from kvpool.memory.arena_stats import ArenaOutOfMemoryError

ARENA_NBYTES = 16384
CONFIG_FIELDS = {"size_classes": (512, 1024, 2048), "large_granule": 1024}


class ArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.arena: Arena
        self.live: list[ArenaHandle] = []
        self.expected: dict[int, torch.Tensor] = {}  # id(handle) -> bytes it wrote
        self.reported_offsets: dict[int, int] = {}  # id(handle) -> last offset told by on_move
        self.next_seed = 0

    @initialize(policy=st.sampled_from(list(PlacementPolicy)))
    def make_arena(self, policy: PlacementPolicy) -> None:
        config = ArenaConfig(policy=policy, **CONFIG_FIELDS)
        self.arena = Arena(torch.zeros(ARENA_NBYTES, dtype=torch.uint8), config)

    def _on_move(self, handle: ArenaHandle, old_offset: int, new_offset: int) -> None:
        assert new_offset < old_offset, "compaction only slides down"
        event("owner told of a move")
        self.reported_offsets[id(handle)] = new_offset

    @rule(
        nbytes=st.integers(1, 5000),
        size_class=st.booleans(),
        relocatable=st.booleans(),
        alignment=st.sampled_from([None, 512, 768, 1024]),
    )
    def allocate(self, nbytes: int, size_class: bool, relocatable: bool,
                 alignment: int | None) -> None:
        try:
            handle = self.arena.allocate(nbytes, size_class=size_class, relocatable=relocatable,
                                         alignment=alignment, on_move=self._on_move)
        except ArenaOutOfMemoryError as error:
            self._check_failure_was_real(error, alignment)
            event("allocation failed")
            return
        self.next_seed += 1
        pattern = ((torch.arange(nbytes) * 31 + self.next_seed) % 256).to(torch.uint8)
        handle.view(torch.uint8).copy_(pattern)
        self.live.append(handle)
        self.expected[id(handle)] = pattern
        self.reported_offsets[id(handle)] = handle.offset

    def _check_failure_was_real(self, error: ArenaOutOfMemoryError, alignment: int | None) -> None:
        # After a failure the caches were flushed, so the free list is all the free space, and
        # no free range may hold the request at a suitably aligned offset.
        assert self.arena.stats().num_cached_bytes == 0
        step = math.lcm(alignment or 1, 256)
        for free_range in self.arena.free_ranges():
            placed = align_up(free_range.offset, step)
            assert placed + error.num_rounded_bytes > free_range.end

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 10**6))
    def free(self, index: int) -> None:
        handle = self.live.pop(index % len(self.live))
        self.arena.free(handle)
        del self.expected[id(handle)]

    @rule()
    def compact(self) -> None:
        if self.arena.compact().num_moved:
            event("compaction moved data")
        # Holes may remain only in front of pinned allocations or as alignment padding.
        num_hole_makers = sum(not h.relocatable or h.alignment > 256 for h in self.live)
        assert self.arena.stats().num_free_ranges <= 1 + num_hole_makers

    @rule()
    def release_cached(self) -> None:
        self.arena.release_cached()
        assert self.arena.stats().num_cached_bytes == 0

    @invariant()
    def arena_invariants_hold(self) -> None:
        # Ranges tile the arena without overlap, bytes are conserved, free neighbours are
        # coalesced, every live offset is aligned.
        self.arena.check_invariants()
        assert self.arena.stats().num_live_allocations == len(self.live)

    @invariant()
    def handles_read_what_they_wrote(self) -> None:
        for handle in self.live:
            assert handle.offset % handle.alignment == 0
            assert self.reported_offsets[id(handle)] == handle.offset
            assert torch.equal(handle.view(torch.uint8), self.expected[id(handle)])


ArenaMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)
TestArenaStateMachine = ArenaMachine.TestCase

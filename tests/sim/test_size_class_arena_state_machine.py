"""Property test: random allocate / free / compact / flush sequences on a small size-class
arena, under every placement policy, keep the arena's invariants and every allocation's data,
and give everything back at quiescence."""

from __future__ import annotations

import torch
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvpool.memory.arena import ArenaConfig, ArenaOutOfMemoryError, PlacementPolicy
from kvpool.sim.size_class_arena import ClassedHandle, SizeClassArena, SizeClasses
from tests.memory.arena_checks import assert_arena_empty, assert_no_free_range_fits, write_pattern

ARENA_NBYTES = 16384
CLASSES = SizeClasses(sizes=(512, 1024, 2048), large_granule=1024)


class SizeClassArenaMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.arena: SizeClassArena
        self.live: list[ClassedHandle] = []
        self.expected: dict[int, torch.Tensor] = {}  # id(handle) -> bytes it wrote
        self.next_seed = 0

    @initialize(policy=st.sampled_from(list(PlacementPolicy)))
    def make_arena(self, policy: PlacementPolicy) -> None:
        buffer = torch.zeros(ARENA_NBYTES, dtype=torch.uint8)
        self.arena = SizeClassArena(buffer, ArenaConfig(policy=policy), CLASSES)

    def _bytes(self, handle: ClassedHandle) -> torch.Tensor:
        return self.arena.buffer[handle.offset : handle.offset + handle.nbytes]

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
                                         alignment=alignment)
        except ArenaOutOfMemoryError as error:
            self._check_failure_was_real(error, alignment)
            event("allocation failed")
            return
        self.next_seed += 1
        self.live.append(handle)
        self.expected[id(handle)] = write_pattern(self._bytes(handle), self.next_seed)

    def _check_failure_was_real(self, error: ArenaOutOfMemoryError, alignment: int | None) -> None:
        # After a failure the caches were flushed, so the free list is all the free space, and
        # no free range may hold the request at a suitably aligned offset.
        assert self.arena.class_stats().num_cached_bytes == 0
        assert_no_free_range_fits(self.arena, error, alignment)

    @precondition(lambda self: bool(self.live))
    @rule(index=st.integers(0, 10**6))
    def free(self, index: int) -> None:
        handle = self.live.pop(index % len(self.live))
        self.arena.free(handle)
        del self.expected[id(handle)]

    @rule()
    def compact(self) -> None:
        before = {id(handle): handle.offset for handle in self.live}
        if self.arena.compact().num_moved:
            event("compaction moved data")
        for handle in self.live:
            assert handle.offset <= before[id(handle)], "compaction only slides down"
            assert handle.relocatable or handle.offset == before[id(handle)]
        # Holes may remain only in front of pinned allocations or as alignment padding.
        num_hole_makers = sum(not h.relocatable or h.alignment > 256 for h in self.live)
        assert self.arena.stats().num_free_ranges <= 1 + num_hole_makers

    @rule()
    def release_cached(self) -> None:
        self.arena.release_cached()
        assert self.arena.class_stats().num_cached_bytes == 0
        assert self.arena.cached_ranges() == []

    @invariant()
    def arena_invariants_hold(self) -> None:
        # Live, cached and free ranges tile the arena without overlap, bytes are conserved,
        # free neighbours are coalesced, every live offset is aligned.
        self.arena.check_invariants()
        assert self.arena.stats().num_live_allocations == len(self.live)

    @invariant()
    def handles_read_what_they_wrote(self) -> None:
        for handle in self.live:
            assert handle.offset % handle.alignment == 0
            assert torch.equal(self._bytes(handle), self.expected[id(handle)])

    def teardown(self) -> None:
        if not hasattr(self, "arena"):
            return
        for handle in self.live:
            self.arena.free(handle)
        self.live.clear()
        self.arena.release_cached()
        assert_arena_empty(self.arena, ARENA_NBYTES)


SizeClassArenaMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=40,
                                                   deadline=None)
TestSizeClassArenaStateMachine = SizeClassArenaMachine.TestCase

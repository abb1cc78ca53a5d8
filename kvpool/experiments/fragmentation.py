"""Experiment 3: external fragmentation under contiguous allocation, and none with paging.

A 100-block pool serves request A (20 blocks), request B (30 blocks) and a long-running request
D (40 blocks) that keeps the tail busy; then A finishes. 30 blocks are free, in two runs of 20
and 10, so request C (25 blocks) fails under contiguous first-fit allocation although enough
memory is free. The paged `BlockPool` does not need a sequence's blocks to be adjacent, so C
gets 25 blocks from the very same state.

(The seed runs only A and B. Then blocks 50..99 stay free and C fits there contiguously; the
last line of output shows it. Request D is what makes the fragmentation bite.)

Run: python -m kvpool.experiments.fragmentation
"""

from __future__ import annotations

from kvpool.memory import BlockPool
from kvpool.memory.kv_layout import KVLayout

NUM_BLOCKS = 100


class ContiguousAllocator:
    """BASELINE, not part of kvpool: first-fit allocation of one contiguous run per request,
    as an engine that reserves one flat KV buffer per sequence must do."""

    def __init__(self, num_blocks: int) -> None:
        self.is_used = [False] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.is_used.count(False)

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, length) of every maximal run of free blocks."""
        runs, start = [], None
        for block_id, is_used in enumerate([*self.is_used, True]):  # sentinel closes the last run
            if not is_used and start is None:
                start = block_id
            elif is_used and start is not None:
                runs.append((start, block_id - start))
                start = None
        return runs

    def largest_free_run(self) -> int:
        return max((length for _, length in self.free_runs()), default=0)

    def allocate(self, num_blocks: int) -> int | None:
        """Start of the first free run that fits `num_blocks`, now used; None if none fits."""
        for start, length in self.free_runs():
            if length >= num_blocks:
                self.is_used[start : start + num_blocks] = [True] * num_blocks
                return start
        return None

    def free(self, start: int, num_blocks: int) -> None:
        assert all(self.is_used[start : start + num_blocks]), "freeing blocks that are not used"
        self.is_used[start : start + num_blocks] = [False] * num_blocks


def seed_layout_has_room() -> int | None:
    """The seed's exact steps (A and B only): where a contiguous C would land."""
    allocator = ContiguousAllocator(NUM_BLOCKS)
    start_a = allocator.allocate(20)
    allocator.allocate(30)
    allocator.free(start_a, 20)
    return allocator.allocate(25)


def run_contiguous() -> int | None:
    allocator = ContiguousAllocator(NUM_BLOCKS)
    starts = [allocator.allocate(num_blocks) for num_blocks in (20, 30, 40)]  # A, B, D
    assert starts == [0, 20, 50]
    start_a = starts[0]
    print("contiguous: A at 0..19, B at 20..49, D at 50..89")
    allocator.free(start_a, 20)
    print(f"contiguous: A freed -> {allocator.num_free_blocks} blocks free, "
          f"free runs (start, length) {allocator.free_runs()}, "
          f"largest free run {allocator.largest_free_run()}")
    start_c = allocator.allocate(25)
    print(f"contiguous: C asks for 25 blocks -> {'FAILS' if start_c is None else start_c}")
    assert allocator.largest_free_run() == 20 and allocator.num_free_blocks == 30
    return start_c


def run_paged() -> BlockPool:
    pool = BlockPool(NUM_BLOCKS, KVLayout(16))
    blocks_a, _blocks_b, _blocks_d = pool.allocate(20), pool.allocate(30), pool.allocate(40)
    pool.free(reversed(blocks_a))
    print(f"paged:      A freed -> {pool.num_free_blocks} blocks free")
    blocks_c = pool.allocate(25)
    # A's blocks were freed tail first, so the LIFO free stack hands them back 1, 2, ..., 20
    # (id 0 is the null block, never handed out).
    assert blocks_c == [*range(1, 21), *range(91, 96)] and pool.num_free_blocks == 5
    print("paged:      C asks for 25 blocks -> succeeds with blocks 1..20 and 91..95 "
          "(not adjacent, and it does not need them to be)")
    return pool


def main() -> BlockPool:
    """Run the experiment; returns the paged pool so a caller can report on it."""
    start_c = run_contiguous()
    assert start_c is None, "the contiguous baseline must fail here"
    pool = run_paged()
    print("fragmentation: 30 blocks free but no 25-block run (contiguous), "
          "25 of 30 free blocks handed out (paged)")
    seed_start = seed_layout_has_room()
    assert seed_start == 50
    print(f"note: with the seed's steps only (A, B, no D) the tail stays free and a contiguous C "
          f"fits at block {seed_start}")
    return pool


if __name__ == "__main__":
    main()

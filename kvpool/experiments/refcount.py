"""Experiment 1: reference-counted allocation and release, with no leak.

Request A takes two blocks; a second request shares A's first block (its prompt prefix) by
taking a reference on it. Releasing in any order returns a block only when its last holder lets
go, and at the end every block is free again. A double free is refused and changes nothing.

Run: python -m kvpool.experiments.refcount
"""

from __future__ import annotations

from kvpool.memory import BlockPool, InvalidBlockError
from kvpool.memory.kv_layout import KVLayout

NUM_BLOCKS = 16


def show(pool: BlockPool, what: str, block_ids: list[int]) -> None:
    counts = ", ".join(f"block {b}: ref_count {pool.ref_count(b)}" for b in block_ids)
    print(f"{what:<34} {counts}   (free: {pool.num_free_blocks}/{pool.num_blocks})")


def main() -> BlockPool:
    """Run the experiment; returns the pool so a caller can report on it."""
    pool = BlockPool(NUM_BLOCKS, KVLayout(16))
    first_id, second_id = pool.allocate(2)
    show(pool, "request A allocates 2 blocks:", [first_id, second_id])

    pool.retain([first_id])  # request B shares A's first block: no copy, one more reference
    show(pool, "request B retains the first:", [first_id, second_id])

    pool.free([first_id])
    show(pool, "A releases the first (B holds it):", [first_id, second_id])
    assert pool.ref_count(first_id) == 1 and pool.num_free_blocks == NUM_BLOCKS - 2

    pool.free([second_id])
    show(pool, "A releases the second:", [first_id, second_id])
    pool.free([first_id])
    show(pool, "B releases the first:", [first_id, second_id])

    try:
        pool.free([first_id])
    except InvalidBlockError as error:
        print(f"a double free is refused: {error}")
    else:
        raise AssertionError("a double free must raise")

    pool.check_invariants()
    stats = pool.stats()
    assert stats.num_free_blocks == NUM_BLOCKS and stats.num_used_blocks == 0
    assert stats.num_allocations == stats.num_frees == 2
    print(f"all {stats.num_free_blocks} blocks free again: no leak "
          f"({stats.num_allocations} allocations, {stats.num_frees} frees)")
    return pool


if __name__ == "__main__":
    main()

"""Experiment 2: a block table maps a sequence's logical blocks to physical pool blocks.

Two sequences grow in turns, as a server interleaves requests, so sequence A's blocks are not
contiguous in the pool. A new block is taken only when the last one is full (one token at a
time, as decode appends), and every token's KV slot is `block_id * block_size + offset`.

Run: python -m kvpool.experiments.block_table
"""

from __future__ import annotations

from kvpool.memory import BlockPool, SequenceBlocks
from kvpool.memory.kv_layout import KVLayout

BLOCK_SIZE = 4


def append_one_at_a_time(table: SequenceBlocks, token_ids: list[int]) -> list[int]:
    """Append like decode does; returns the positions at which a new block was taken."""
    new_block_positions = []
    for token_id in token_ids:
        num_blocks_before = table.num_blocks
        table.append_tokens([token_id])
        if table.num_blocks > num_blocks_before:
            new_block_positions.append(table.num_tokens - 1)
    return new_block_positions


def print_table(name: str, table: SequenceBlocks) -> None:
    print(f"sequence {name}: {table.num_tokens} tokens in {table.num_blocks} blocks")
    for logical, block_id in enumerate(table.block_ids):
        num_filled = min(BLOCK_SIZE, table.num_tokens - logical * BLOCK_SIZE)
        print(f"  logical block {logical} -> physical block {block_id:2d}  "
              f"({num_filled}/{BLOCK_SIZE} slots filled)")


def main() -> BlockPool:
    """Run the experiment; returns the pool so a caller can report on it."""
    pool = BlockPool(16, KVLayout(BLOCK_SIZE))
    table_a, table_b = SequenceBlocks(pool), SequenceBlocks(pool)
    table_a.append_tokens(list(range(100, 106)))  # A's prompt: 6 tokens -> blocks 1, 2
    table_b.append_tokens(list(range(200, 205)))  # B's prompt: 5 tokens -> blocks 3, 4
    new_block_positions = append_one_at_a_time(table_a, list(range(106, 113)))  # A decodes 7
    print(f"A decoded 7 tokens; a new block was taken only at positions {new_block_positions}")
    assert new_block_positions == [8, 12]

    print_table("A", table_a)
    print_table("B", table_b)
    assert table_a.block_ids == [1, 2, 5, 6] and table_b.block_ids == [3, 4]

    layout = pool.layout  # owns the slot formula
    for position in (0, 5, 8, 12):
        block_id, offset = table_a.block_ids[position // BLOCK_SIZE], position % BLOCK_SIZE
        slot = layout.slot(table_a.block_ids, position)
        print(f"  A position {position:2d} -> slot {slot:2d}"
              f" = block {block_id} * {BLOCK_SIZE} + offset {offset}")
        assert slot == block_id * BLOCK_SIZE + offset
    print(f"slot mapping of A's 7 decoded tokens: {layout.slot_mapping(table_a.block_ids, 6, 13)}")

    table_a.free()
    table_b.free()
    assert pool.num_used_blocks == 0
    print(f"both tables freed: {pool.num_allocatable_blocks}/{pool.num_blocks} blocks reusable")
    return pool


if __name__ == "__main__":
    main()

"""One sequence's block tables, one per KV cache group, moved as one.

A hybrid model's sequence has a `BlockTable` per group (`kvpool.memory.kv_groups`): the full
group's keeps a block for every token, a sliding group's drops what falls out of its window.
They always agree on the sequence's tokens; only which blocks are still held differs. This
class gives them `BlockTable`'s interface so the owner of the tokens (`SequenceBlocks`, the
engine's sequence) drives one object:

- growth is planned over every group first (`HybridBlockPool.make_allocatable`), so it is all
  or nothing across groups as `BlockTable.append_slots` is within one;
- copies-on-write come back tagged with their group (`BlockCopy.group`), since each group's KV
  lives in its own view;
- a prefix hit is a `GroupMatch` (`kvpool.memory.hybrid_prefix`): every group takes its part.

Invariants: every table has the same `num_tokens`, `num_tentative` and `num_published_blocks`
(`check`); table g holds blocks of `pool.pools[g]` only.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.block_table import BlockCopy, BlockTable, TokenRange
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.hybrid_pool import HybridBlockPool
from kvpool.memory.hybrid_prefix import GroupMatch
from kvpool.memory.prefix_cache import BlockHash


class GroupBlockTables:
    """A `BlockTable` per group of `pool`, grown, published, forked and freed together."""

    def __init__(self, pool: HybridBlockPool,
                 tables: Sequence[BlockTable] | None = None) -> None:
        self.pool = pool
        if tables is None:
            pairs = zip(pool.pools, pool.groups, strict=True)
            tables = [BlockTable(group_pool, group) for group_pool, group in pairs]
        self.tables = tuple(tables)

    # ----------------------------------------------------------------- queries
    @property
    def num_tokens(self) -> int:
        return self.tables[0].num_tokens

    @property
    def num_published_blocks(self) -> int:
        return self.tables[0].num_published_blocks

    @property
    def num_tentative(self) -> int:
        return self.tables[0].num_tentative

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def block_ids(self) -> list[int]:
        """The first group's blocks (the full-attention group's, if the model has one)."""
        return self.tables[0].block_ids

    @property
    def num_blocks(self) -> int:
        return self.tables[0].num_blocks

    @property
    def live_block_ids(self) -> list[int]:
        return self.tables[0].live_block_ids

    @property
    def group_block_ids(self) -> tuple[list[int], ...]:
        return tuple(table.block_ids for table in self.tables)

    @property
    def group_live_block_ids(self) -> tuple[list[int], ...]:
        return tuple(table.live_block_ids for table in self.tables)

    def num_blocks_to_append(self, num_new_tokens: int) -> int:
        """Blocks over every group that `append_slots` takes for `num_new_tokens` tokens."""
        return sum(self.group_demands(num_new_tokens))

    def group_demands(self, num_new_tokens: int) -> list[int]:
        return [table.num_blocks_to_append(num_new_tokens) for table in self.tables]

    # ------------------------------------------------------------------ growth
    def append_slots(self, num_new_tokens: int) -> list[BlockCopy]:
        """`BlockTable.append_slots` in every group, all or nothing across them (but for the
        dead blocks each window drops first, so that their pages count as allocatable)."""
        self.drop_dead_blocks()
        self._reserve(num_new_tokens)
        return self._tagged([table.append_slots(num_new_tokens) for table in self.tables])

    def append_tentative_slots(self, num_draft_tokens: int) -> list[BlockCopy]:
        self._reserve(num_draft_tokens)
        return self._tagged([t.append_tentative_slots(num_draft_tokens) for t in self.tables])

    def _reserve(self, num_new_tokens: int) -> None:
        """Pages for every group's new blocks, or OutOfBlocksError with nothing taken."""
        demands = self.group_demands(num_new_tokens)
        if not self.pool.make_allocatable(demands):
            raise OutOfBlocksError(sum(demands), 0, 0)

    def drop_dead_blocks(self) -> list[int]:
        """Every window group releases what no later query reads (`BlockTable`); returns the
        first group's (what events report, as `block_ids` is the first group's)."""
        dropped = [table.drop_dead_blocks() for table in self.tables]  # every group drops
        return dropped[0]

    def commit_tentative(self, num_accepted: int) -> list[int]:
        """Every group keeps the same drafts; returns the first group's blocks given back
        (what events report, as `block_ids` is the first group's)."""
        dropped = [table.commit_tentative(num_accepted) for table in self.tables]
        return dropped[0]

    def mark_computed(self, num_computed_tokens: int, token_ids: TokenRange,
                      block_hashes: Sequence[BlockHash]) -> None:
        for table in self.tables:
            table.mark_computed(num_computed_tokens, token_ids, block_hashes)

    def take_prefix(self, match: GroupMatch) -> int:
        for table, group_match in zip(self.tables, match.matches, strict=True):
            table.take_prefix(group_match)
        return match.num_cached_tokens

    def restore(self, num_tokens: int, num_dropped: Sequence[int]) -> None:
        """`BlockTable.restore` in every group (`num_dropped[g]` null blocks first in group
        g), all or nothing across them."""
        num_blocks = self.pool.groups[0].layout.num_blocks_for_tokens(num_tokens)
        demands = [num_blocks - dropped for dropped in num_dropped]
        if not self.pool.make_allocatable(demands):
            raise OutOfBlocksError(sum(demands), 0, 0)
        for table, dropped in zip(self.tables, num_dropped, strict=True):
            table.restore(num_tokens, dropped)

    # ---------------------------------------------------------- share / free
    def fork(self) -> GroupBlockTables:
        return GroupBlockTables(self.pool, [table.fork() for table in self.tables])

    def free(self) -> None:
        for table in self.tables:
            table.free()

    def check(self) -> None:
        """Assert the module docstring's invariants."""
        first = self.tables[0]
        for table in self.tables:
            assert (table.num_tokens, table.num_tentative, table.num_published_blocks) == (
                first.num_tokens, first.num_tentative, first.num_published_blocks)

    @staticmethod
    def _tagged(copies_by_group: list[list[BlockCopy]]) -> list[BlockCopy]:
        return [BlockCopy(copy.src_block_id, copy.dst_block_id, group)
                for group, copies in enumerate(copies_by_group) for copy in copies]


def new_block_table(pool: BlockPool | HybridBlockPool) -> BlockTable | GroupBlockTables:
    """An empty table of `pool`: one per group for a hybrid pool."""
    return GroupBlockTables(pool) if isinstance(pool, HybridBlockPool) else BlockTable(pool)

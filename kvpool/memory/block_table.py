"""A sequence's block table: the map from its logical blocks to physical pool blocks.

Token position p lives in logical block p // block_size at offset p % block_size; its *slot*
in the KV tensors is `KVLayout.slot(block_ids, p)`:

    token positions   0 .. 15 | 16 .. 31 | 32 .. 37
    logical block        0    |    1     |    2      (last block: 6 of 16 slots filled)
    physical block       7    |    3     |   12

The table keeps counts, not tokens: the sequence that owns it owns its tokens and their hash
chain (the engine's `Sequence`, or `SequenceBlocks` for the memory core used on its own), and
hands them to `mark_computed` when full blocks are to be published to the prefix cache.

Invariants:
- `len(block_ids) == ceil(num_tokens / block_size)`: every block but the last is full, and a
  block is taken only when the previous one is full.
- The table holds exactly one reference on each entry of `block_ids` but the first
  `num_dropped_blocks`, which are the null block: blocks of a sliding-window group
  (`kvpool.memory.kv_groups`) that no later query reads, released as the sequence grows
  (`append_slots` drops them first, so the step's new blocks may reuse them). Only published
  blocks are dropped (`num_dropped_blocks <= num_published_blocks`): a dropped block's KV stays
  in the prefix cache until it is evicted. A full-attention table never drops one.
- A block shared with another table (ref_count > 1) is never written: appending into a shared,
  partly filled last block first copies it (copy-on-write) and reports the `BlockCopy` that the
  KV tensors must perform.
- The first `num_published_blocks` blocks are full, were marked computed and were offered to
  the prefix cache, in order; no other block was.
- Physical ids may change between steps (`remap`, when an elastic pool migrates blocks);
  logical positions never do.
- The last `num_tentative` filled slots are *tentative*: speculative decoding's drafted tokens,
  whose KV the verification pass writes before anyone knows whether they are kept. They are
  never published (`mark_computed` stops before them), so never hashed, cached, written to a
  tier or announced as KV events; the owner does not count them as computed. They live within
  one step: `commit_tentative` keeps the accepted ones as ordinary slots and drops the rest,
  returning at once the blocks that held only rejected drafts. Between steps
  `num_tentative == 0`, and `fork` refuses a table that has any.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool
from kvpool.memory.kv_groups import KVGroup
from kvpool.memory.prefix_cache import BlockHash, PrefixMatch

TokenRange = Callable[[int, int], Sequence[int]]  # (start, end) -> the owner's tokens there


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A whole-block KV copy the tensors must perform (copy-on-write, migration), in the KV
    of group `group` (`kvpool.memory.kv_groups`; 0 where there is one group)."""

    src_block_id: int
    dst_block_id: int
    group: int = 0


class BlockTable:
    """Logical → physical blocks of one sequence, and how many of its slots are filled."""

    def __init__(self, pool: BlockPool, group: KVGroup | None = None) -> None:
        """A table of `pool`'s blocks for the layers of `group` (None: every layer, full
        attention: no block is ever dropped)."""
        self.pool = pool
        self.group = group if group is not None and group.window is not None else None
        self.block_ids: list[int] = []
        self.num_tokens = 0  # filled slots: tokens whose KV has (or is about to have) a place
        self.num_published_blocks = 0
        self.num_tentative = 0  # the last filled slots, drafted tokens not yet verified
        self.num_dropped_blocks = 0  # leading entries out of the window: the null block

    # ----------------------------------------------------------------- queries
    @property
    def num_blocks(self) -> int:
        """Logical blocks, the dropped ones included."""
        return len(self.block_ids)

    @property
    def group_block_ids(self) -> tuple[list[int]]:
        """The table as the one group of its sequence (`GroupBlockTables` has several)."""
        return (self.block_ids,)

    @property
    def live_block_ids(self) -> list[int]:
        """The blocks the table holds a reference on (the dropped ones left out)."""
        return self.block_ids[self.num_dropped_blocks:]

    @property
    def group_live_block_ids(self) -> tuple[list[int]]:
        return (self.live_block_ids,)

    @property
    def block_size(self) -> int:
        return self.pool.layout.block_size

    def num_blocks_to_append(self, num_new_tokens: int) -> int:
        """Blocks `append_slots` would allocate for `num_new_tokens` more tokens."""
        num_blocks = self.pool.layout.num_blocks_for_tokens(self.num_tokens + num_new_tokens)
        num_new_blocks = num_blocks - self.num_blocks
        return num_new_blocks + int(num_new_tokens > 0 and self._last_block_needs_copy())

    def _last_block_needs_copy(self) -> bool:
        return self.num_tokens % self.block_size != 0 and self.pool.is_shared(
            self.block_ids[-1])

    # ------------------------------------------------------------------ growth
    def append_slots(self, num_new_tokens: int) -> list[BlockCopy]:
        """Give `num_new_tokens` more tokens slots at the end of the sequence.

        Allocates a block only when the last one is full; copies a shared partly filled last
        block first. All-or-nothing: on `OutOfBlocksError` the table is unchanged. The new
        full blocks are offered to the prefix cache only by `mark_computed`.
        """
        if num_new_tokens <= 0:
            return []
        if self.group is not None:  # the step's first query is at num_tokens: what it
            self.drop_dead_blocks()  # cannot read is dead
        return self._append(num_new_tokens)

    def _append(self, num_new_tokens: int) -> list[BlockCopy]:
        num_new_blocks = self.num_blocks_to_append(num_new_tokens)
        copies = self._grow(num_new_blocks) if num_new_blocks else []
        size = self.block_size
        first_new_block = self.num_tokens // size
        self.num_tokens += num_new_tokens
        num_tokens, block_ids = self.num_tokens, self.block_ids
        for index in range(first_new_block, len(block_ids)):
            self.pool.set_num_filled_slots(block_ids[index], min(size, num_tokens - index * size))
        return copies

    def _grow(self, num_new_blocks: int) -> list[BlockCopy]:
        new_block_ids = self.pool.allocate(num_new_blocks)
        copies: list[BlockCopy] = []
        if self.num_tokens and self._last_block_needs_copy():
            shared_id, private_id = self.block_ids[-1], new_block_ids.pop(0)
            self.pool.free([shared_id])
            self.block_ids[-1] = private_id
            copies.append(BlockCopy(shared_id, private_id))
        self.block_ids.extend(new_block_ids)
        return copies

    def drop_dead_blocks(self) -> list[int]:
        """Release the published blocks no query from the next position on reads (a sliding
        window's, oldest first, so they are evicted first); returns their ids (none for full
        attention)."""
        if self.group is None:
            return []
        first_live = min(self.group.first_live_block(self.num_tokens), self.num_published_blocks)
        start = self.num_dropped_blocks
        if first_live <= start:
            return []
        dead = self.block_ids[start:first_live]
        self.block_ids[start:first_live] = [NULL_BLOCK_ID] * len(dead)
        self.num_dropped_blocks = first_live
        self.pool.free(dead)
        return dead

    def append_tentative_slots(self, num_draft_tokens: int) -> list[BlockCopy]:
        """Slots for `num_draft_tokens` drafted tokens after the filled ones, tentative until
        `commit_tentative` (`append_slots`' rules: all or nothing)."""
        # No drop: the step's own tokens, before the drafts, have queries that read further back.
        copies = self._append(num_draft_tokens) if num_draft_tokens > 0 else []
        self.num_tentative += max(num_draft_tokens, 0)
        return copies

    def commit_tentative(self, num_accepted: int) -> list[int]:
        """Keep the first `num_accepted` tentative slots as ordinary filled slots and drop
        the others; the blocks that held only dropped slots go back to the pool now (never
        published, so to the free list). Returns their ids. O(drafts), not O(sequence)."""
        if not 0 <= num_accepted <= self.num_tentative:
            raise ValueError(f"cannot accept {num_accepted} of {self.num_tentative} "
                             "tentative slots")
        self.num_tokens -= self.num_tentative - num_accepted
        self.num_tentative = 0
        num_kept = self.pool.layout.num_blocks_for_tokens(self.num_tokens)
        dropped = self.block_ids[num_kept:]
        if dropped:
            del self.block_ids[num_kept:]
            self.pool.free(reversed(dropped))
        if self.block_ids and self.block_ids[-1] != NULL_BLOCK_ID:  # (W = 1: maybe dropped)
            last_start = (num_kept - 1) * self.block_size
            self.pool.set_num_filled_slots(self.block_ids[-1], self.num_tokens - last_start)
        return dropped

    def mark_computed(self, num_computed_tokens: int, token_ids: TokenRange,
                      block_hashes: Sequence[BlockHash]) -> None:
        """Offer every full block within the first `num_computed_tokens` tokens to the prefix
        cache; `token_ids(start, end)` and `block_hashes` (the chain of the owner's full
        blocks, at least those) are the owner's."""
        size = self.block_size
        num_full = min(num_computed_tokens, self.num_tokens - self.num_tentative) // size
        for index in range(self.num_published_blocks, num_full):
            parent = block_hashes[index - 1] if index else None
            self.pool.publish(self.block_ids[index], block_hashes[index],
                              token_ids(index * size, (index + 1) * size), parent)
        self.num_published_blocks = max(self.num_published_blocks, num_full)

    def take_prefix(self, match: PrefixMatch) -> int:
        """Start an empty table from `match` (the pool's `match_prefix` of the owner's
        leading tokens); returns the number of tokens whose KV is reused. Those tokens are
        filled, computed and published."""
        if self.num_tokens:
            raise ValueError("take_prefix needs an empty block table")
        self.block_ids = self.pool.take_prefix(match)
        self.num_tokens = match.num_cached_tokens
        self.num_published_blocks = len(self.block_ids)
        self.num_dropped_blocks = _num_leading_nulls(self.block_ids)
        return match.num_cached_tokens

    def restore(self, num_tokens: int, num_dropped: int = 0) -> None:
        """Start an empty table of `num_tokens` filled slots in new blocks, but for the first
        `num_dropped`, the null block: a swapped-out sequence coming back, whose sliding window
        had dropped those (published then; counted published again, so never re-offered).
        The caller copies the KV in. All or nothing, as `append_slots`."""
        if self.num_tokens:
            raise ValueError("restore needs an empty block table")
        num_blocks = self.pool.layout.num_blocks_for_tokens(num_tokens)
        new_ids = self.pool.allocate(num_blocks - num_dropped)
        self.block_ids = [NULL_BLOCK_ID] * num_dropped + new_ids
        self.num_tokens = num_tokens
        self.num_published_blocks = self.num_dropped_blocks = num_dropped
        size = self.block_size
        for index in range(num_dropped, num_blocks):
            self.pool.set_num_filled_slots(self.block_ids[index],
                                           min(size, num_tokens - index * size))

    # ---------------------------------------------------------- share / free
    def fork(self) -> BlockTable:
        """A new table sharing every block (ref_count + 1 each, nothing copied)."""
        if self.num_tentative:
            raise ValueError("cannot fork a block table with tentative slots")
        self.pool.retain(self.live_block_ids)
        child = BlockTable(self.pool, self.group)
        child.block_ids = list(self.block_ids)
        child.num_tokens = self.num_tokens
        child.num_published_blocks = self.num_published_blocks
        child.num_dropped_blocks = self.num_dropped_blocks
        return child

    def remap(self, old_to_new: dict[int, int]) -> int:
        """Replace migrated block ids in place (the pool already moved their references);
        returns how many entries changed."""
        block_ids = self.block_ids
        num_changed = 0
        for index, block_id in enumerate(block_ids):
            new_id = old_to_new.get(block_id)
            if new_id is not None:
                block_ids[index] = new_id
                num_changed += 1
        return num_changed

    def free(self) -> None:
        """Return every block (tail first, so cached tail blocks are evicted first)."""
        self.pool.free(reversed(self.live_block_ids))
        self.block_ids = []
        self.num_tokens = 0
        self.num_published_blocks = 0
        self.num_tentative = 0
        self.num_dropped_blocks = 0


def _num_leading_nulls(block_ids: list[int]) -> int:
    count = 0
    while count < len(block_ids) and block_ids[count] == NULL_BLOCK_ID:
        count += 1
    return count

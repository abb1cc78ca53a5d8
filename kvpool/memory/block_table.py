"""A sequence's block table: the map from its logical blocks to physical pool blocks.

Token position p lives in logical block p // block_size at offset p % block_size; its *slot*
in the KV tensors is `KVLayout.slot(block_ids, p)`:

    token positions   0 .. 15 | 16 .. 31 | 32 .. 37
    logical block        0    |    1     |    2      (last block: 6 of 16 slots filled)
    physical block       7    |    3     |   12

Invariants:
- `len(block_ids) == ceil(num_tokens / block_size)`: every block but the last is full, and a
  block is taken only when the previous one is full.
- The table holds exactly one reference on each entry of `block_ids`; the null block is never
  one of them.
- A block shared with another table (ref_count > 1) is never written: appending into a shared,
  partly filled last block first copies it (copy-on-write) and reports the `BlockCopy` that the
  KV tensors must perform.
- `block_hashes[i]` is the chained hash of full block i; hashes exist only for the first
  `num_hashed_blocks` blocks, all of which are full and were marked computed.
- Physical ids may change between steps (`remap`, when an elastic pool migrates blocks);
  logical positions, tokens and hashes never do.

The engine hands `mark_computed` the hashes its sequences keep (each prompt is hashed once per
request); used on its own, the table hashes its blocks itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.prefix_cache import (
    BlockHash,
    PrefixMatch,
    hash_block,
    hash_full_blocks,
    salt_key,
)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A whole-block KV copy the tensors must perform (copy-on-write, migration)."""

    src_block_id: int
    dst_block_id: int


class BlockTable:
    """Logical → physical blocks of one sequence, with the token ids its slots hold."""

    def __init__(self, pool: BlockPool, cache_salt: str | None = None) -> None:
        self.pool = pool
        self.salt = salt_key(cache_salt)
        self.block_ids: list[int] = []
        self.token_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []

    # ----------------------------------------------------------------- queries
    @property
    def num_tokens(self) -> int:
        """Filled slots: tokens whose KV has (or is about to have) a place."""
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    @property
    def block_size(self) -> int:
        return self.pool.layout.block_size

    @property
    def num_hashed_blocks(self) -> int:
        return len(self.block_hashes)

    def num_blocks_to_append(self, num_new_tokens: int) -> int:
        """Blocks `append_tokens` would allocate for `num_new_tokens` more tokens."""
        num_blocks = self.pool.layout.num_blocks_for_tokens(self.num_tokens + num_new_tokens)
        num_new_blocks = num_blocks - self.num_blocks
        return num_new_blocks + int(num_new_tokens > 0 and self._last_block_needs_copy())

    def _last_block_needs_copy(self) -> bool:
        return len(self.token_ids) % self.block_size != 0 and self.pool.is_shared(
            self.block_ids[-1])

    # ------------------------------------------------------------------ growth
    def append_tokens(self, token_ids: Sequence[int], computed: bool = True) -> list[BlockCopy]:
        """Give `token_ids` slots at the end of the sequence.

        Allocates a block only when the last one is full; copies a shared partly filled last
        block first. All-or-nothing: on `OutOfBlocksError` the table is unchanged. With
        `computed=False` the new full blocks are not offered to the prefix cache until
        `mark_computed` says their KV has been written.
        """
        if not token_ids:
            return []
        num_new_blocks = self.num_blocks_to_append(len(token_ids))
        copies = self._grow(num_new_blocks) if num_new_blocks else []
        size = self.block_size
        first_new_block = len(self.token_ids) // size
        self.token_ids.extend(token_ids)
        num_tokens, block_ids = len(self.token_ids), self.block_ids
        for index in range(first_new_block, len(block_ids)):
            self.pool.set_num_filled_slots(block_ids[index], min(size, num_tokens - index * size))
        if computed:
            self.mark_computed(num_tokens)
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

    def mark_computed(
        self, num_computed_tokens: int, block_hashes: Sequence[BlockHash] | None = None
    ) -> None:
        """Offer every full block within the first `num_computed_tokens` tokens to the prefix
        cache. `block_hashes`, when given, is the chain of the sequence's full blocks (at least
        those); otherwise the blocks are hashed here."""
        size = self.block_size
        num_full = min(num_computed_tokens, self.num_tokens) // size
        for index in range(self.num_hashed_blocks, num_full):
            tokens = self.token_ids[index * size : (index + 1) * size]
            parent = self.block_hashes[-1] if self.block_hashes else None
            if block_hashes is not None:
                block_hash = block_hashes[index]
            else:
                block_hash = hash_block(parent, tokens, self.salt)
            self.block_hashes.append(block_hash)
            self.pool.publish(self.block_ids[index], block_hash, tokens, parent)

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Chained hashes of the full blocks of `token_ids` under this table's salt."""
        return hash_full_blocks(token_ids, self.block_size, self.salt)

    def take_prefix(self, match: PrefixMatch, token_ids: Sequence[int],
                    block_hashes: Sequence[BlockHash]) -> int:
        """Start an empty table from `match` (the pool's `match_prefix` of `token_ids`, whose
        chained hashes are `block_hashes`); returns the number of tokens whose KV is reused.
        Those tokens are filled and computed."""
        if self.num_tokens:
            raise ValueError("take_prefix needs an empty block table")
        self.block_ids = self.pool.take_prefix(match)
        self.token_ids = list(token_ids[: match.num_cached_tokens])
        self.block_hashes = list(block_hashes[: len(self.block_ids)])
        return match.num_cached_tokens

    def take_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """`take_prefix` of the longest cached prefix of `token_ids`, hashed here."""
        hashes = self.prefix_hashes(token_ids)
        return self.take_prefix(self.pool.match_prefix(hashes, token_ids), token_ids, hashes)

    # ---------------------------------------------------------- share / free
    def fork(self) -> BlockTable:
        """A new table sharing every block (ref_count + 1 each, nothing copied)."""
        self.pool.retain(self.block_ids)
        child = BlockTable(self.pool)
        child.salt = self.salt
        child.block_ids = list(self.block_ids)
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
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
        self.pool.free(reversed(self.block_ids))
        self.block_ids = []
        self.token_ids = []
        self.block_hashes = []

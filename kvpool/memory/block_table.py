"""A sequence's block table: the map from its logical blocks to physical pool blocks.

Token position p lives in logical block p // block_size at offset p % block_size; its *slot* in
the KV tensors is `block_ids[p // block_size] * block_size + p % block_size`.

    token positions   0 .. 15 | 16 .. 31 | 32 .. 37
    logical block        0    |    1     |    2      (last block: 6 of 16 slots filled)
    physical block       7    |    3     |   12

Invariants:
- `len(block_ids) == ceil(num_tokens / block_size)`: every block but the last is full, and a
  block is taken only when the previous one is full.
- The table holds exactly one reference on each entry of `block_ids`.
- A block shared with another table (ref_count > 1) is never written: appending into a shared,
  partly filled last block first copies it (copy-on-write) and reports the `BlockCopy` that the
  KV tensors must perform.
- `block_hashes[i]` is the chained hash of full block i; hashes exist only for the first
  `num_hashed_blocks` blocks, all of which are full and were marked computed.
- Physical ids may change between steps (`remap`, when an elastic pool migrates blocks);
  logical positions, tokens and hashes never do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.prefix_cache import (
    BlockHash,
    encode_extra_keys,
    hash_block,
    hash_full_blocks,
)


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """A whole-block KV copy the tensors must perform (copy-on-write, migration)."""

    src_block_id: int
    dst_block_id: int


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class BlockTable:
    """Logical → physical blocks of one sequence, with the token ids its slots hold."""

    def __init__(self, pool: BlockPool, cache_salt: str | None = None) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.cache_salt = cache_salt
        self.extra_keys = encode_extra_keys(cache_salt)
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
    def num_hashed_blocks(self) -> int:
        return len(self.block_hashes)

    def slot(self, position: int) -> int:
        """The KV slot of the token at `position`."""
        if not 0 <= position < self.num_tokens:
            raise IndexError(f"position {position} outside 0..{self.num_tokens - 1}")
        return (
            self.block_ids[position // self.block_size] * self.block_size
            + position % self.block_size
        )

    def slots(self, start: int, end: int) -> list[int]:
        """Slots of positions start..end-1 (the slot mapping of a step's new tokens)."""
        size, block_ids = self.block_size, self.block_ids
        return [block_ids[p // size] * size + p % size for p in range(start, end)]

    def num_blocks_to_append(self, num_new_tokens: int) -> int:
        """Blocks `append_tokens` would allocate for `num_new_tokens` more tokens."""
        num_new_blocks = cdiv(self.num_tokens + num_new_tokens, self.block_size) - self.num_blocks
        return num_new_blocks + int(num_new_tokens > 0 and self._last_block_needs_copy())

    def _last_block_needs_copy(self) -> bool:
        return (
            self.num_tokens % self.block_size != 0 and self.pool.is_shared(self.block_ids[-1])
        )

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
        first_new_block = len(self.token_ids) // self.block_size
        self.token_ids.extend(token_ids)
        for index in range(first_new_block, self.num_blocks):
            filled = min(self.block_size, self.num_tokens - index * self.block_size)
            self.pool.set_num_filled_slots(self.block_ids[index], filled)
        if computed:
            self.mark_computed(self.num_tokens)
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

    def mark_computed(self, num_computed_tokens: int) -> None:
        """Hash every full block within the first `num_computed_tokens` tokens and offer it to
        the prefix cache."""
        size = self.block_size
        num_full = min(num_computed_tokens, self.num_tokens) // size
        for index in range(self.num_hashed_blocks, num_full):
            parent = self.block_hashes[-1] if self.block_hashes else None
            tokens = self.token_ids[index * size : (index + 1) * size]
            block_hash = hash_block(parent, tokens, self.extra_keys)
            self.block_hashes.append(block_hash)
            self.pool.publish(self.block_ids[index], block_hash, tokens)

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Chained hashes of the full blocks of `token_ids` under this table's salt."""
        return hash_full_blocks(token_ids, self.block_size, self.extra_keys)

    def take_cached_prefix(
        self, token_ids: Sequence[int], block_hashes: Sequence[BlockHash] | None = None
    ) -> int:
        """Start an empty table from the longest cached prefix of `token_ids`.

        Returns the number of tokens whose KV is reused; those tokens are filled and computed.
        """
        if self.num_tokens:
            raise ValueError("take_cached_prefix needs an empty block table")
        hashes = list(block_hashes) if block_hashes is not None else self.prefix_hashes(token_ids)
        hit_ids = self.pool.take_prefix(hashes, token_ids)
        num_cached_tokens = len(hit_ids) * self.block_size
        self.block_ids = hit_ids
        self.token_ids = list(token_ids[:num_cached_tokens])
        self.block_hashes = hashes[: len(hit_ids)]
        return num_cached_tokens

    # ---------------------------------------------------------- share / free
    def fork(self) -> BlockTable:
        """A new table sharing every block (ref_count + 1 each, nothing copied)."""
        self.pool.retain(self.block_ids)
        child = BlockTable(self.pool, self.cache_salt)
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

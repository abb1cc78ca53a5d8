"""A sequence for the memory core used on its own: its tokens, their hash chain and its table.

The engine's `Sequence` owns a request's tokens and hashes; the simulator, the experiments,
the block benchmark and anyone driving `kvpool.memory` directly use this instead, the way the
seed's `BlockManager` was used:

    blocks = SequenceBlocks(pool)
    blocks.append_tokens([11, 12, 13, 14, 15])  # slots, and full computed blocks published
    other = SequenceBlocks(pool)
    other.take_cached_prefix([11, 12, 13, 14, 20])   # 4 tokens reused from the prefix cache

Invariants: `block_hashes` is the salted chain of the first `len(token_ids) // block_size`
blocks of `token_ids` (hashed here, once each); the table (`table`) has one filled slot per
token and has published exactly the computed full blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.group_tables import new_block_table
from kvpool.memory.hybrid_pool import HybridBlockPool
from kvpool.memory.hybrid_prefix import GroupMatch
from kvpool.memory.prefix_cache import BlockHash, PrefixMatch, hash_full_blocks, salt_key


class SequenceBlocks:
    """Tokens, their chained block hashes under one salt, and the block table holding them."""

    def __init__(self, pool: BlockPool | HybridBlockPool, cache_salt: str | None = None) -> None:
        """Empty, on `pool`: a hybrid pool gives the sequence a table per KV cache group."""
        self.pool = pool
        self.salt = salt_key(cache_salt)
        self.table = new_block_table(pool)
        self.token_ids: list[int] = []
        self.block_hashes: list[BlockHash] = []

    # ----------------------------------------------------------------- queries
    @property
    def block_ids(self) -> list[int]:
        return self.table.block_ids

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_blocks(self) -> int:
        return self.table.num_blocks

    @property
    def block_size(self) -> int:
        return self.table.block_size

    @property
    def num_published_blocks(self) -> int:
        return self.table.num_published_blocks

    def num_blocks_to_append(self, num_new_tokens: int) -> int:
        return self.table.num_blocks_to_append(num_new_tokens)

    def prefix_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        """Chained hashes of the full blocks of `token_ids` under this sequence's salt."""
        return hash_full_blocks(token_ids, self.block_size, self.salt)

    # ------------------------------------------------------------------ growth
    def append_tokens(self, token_ids: Sequence[int], computed: bool = True) -> list[BlockCopy]:
        """Slots for `token_ids` (`BlockTable.append_slots`: all or nothing); with `computed`
        the full blocks are published at once, else only at `mark_computed`."""
        copies = self.table.append_slots(len(token_ids))
        self._extend(token_ids, computed)
        return copies

    def _extend(self, token_ids: Sequence[int], computed: bool) -> None:
        """The tokens join the sequence (their slots already taken): full blocks hashed, and
        published with `computed`."""
        tokens, hashes = self.token_ids, self.block_hashes
        tokens.extend(token_ids)
        size = self.table.block_size
        num_full = len(tokens) // size
        if num_full > len(hashes):  # a block filled up: hash it (the common decode append
            num_hashed = len(hashes) * size  # fills none, and pays two comparisons)
            parent = hashes[-1] if hashes else None
            hashes.extend(hash_full_blocks(tokens[num_hashed:], size, self.salt, parent))
        if computed and num_full > self.table.num_published_blocks:
            self.mark_computed(len(tokens))

    def draft(self, num_draft_tokens: int) -> list[BlockCopy]:
        """Tentative slots for drafted tokens (speculative decoding): their KV is written,
        but they join the sequence only if `commit_draft` accepts them."""
        return self.table.append_tentative_slots(num_draft_tokens)

    def commit_draft(self, accepted: Sequence[int]) -> list[int]:
        """The verified drafts `accepted` (a prefix of those drafted) join the sequence,
        computed; the rest vanish with the blocks that held only them (returned)."""
        dropped = self.table.commit_tentative(len(accepted))
        self._extend(accepted, computed=True)
        return dropped

    def mark_computed(self, num_computed_tokens: int) -> None:
        """Publish the full blocks within the first `num_computed_tokens` tokens."""
        self.table.mark_computed(num_computed_tokens, self._tokens, self.block_hashes)

    def _tokens(self, start: int, end: int) -> list[int]:
        return self.token_ids[start:end]

    def take_prefix(self, match: PrefixMatch | GroupMatch, token_ids: Sequence[int],
                    block_hashes: Sequence[BlockHash]) -> int:
        """Start empty from `match` (the pool's `match_prefix` of `token_ids`, whose chained
        hashes are `block_hashes`); returns the number of tokens whose KV is reused (filled,
        computed)."""
        if self.token_ids:
            raise ValueError("take_prefix needs an empty sequence")
        num_cached = self.table.take_prefix(match)
        self.token_ids = list(token_ids[:num_cached])
        self.block_hashes = list(block_hashes[: num_cached // self.block_size])
        return num_cached

    def take_cached_prefix(self, token_ids: Sequence[int]) -> int:
        """`take_prefix` of the longest cached prefix of `token_ids`, hashed here."""
        hashes = self.prefix_hashes(token_ids)
        return self.take_prefix(self.pool.match_prefix(hashes, token_ids), token_ids, hashes)

    # ---------------------------------------------------------- share / free
    def fork(self) -> SequenceBlocks:
        """A new sequence sharing every block (ref_count + 1 each, nothing copied)."""
        child = SequenceBlocks.__new__(SequenceBlocks)
        child.pool, child.salt, child.table = self.pool, self.salt, self.table.fork()
        child.token_ids = list(self.token_ids)
        child.block_hashes = list(self.block_hashes)
        return child

    def remap(self, old_to_new: dict[int, int]) -> int:
        return self.table.remap(old_to_new)

    def free(self) -> None:
        """Return every block; the tokens go too."""
        self.table.free()
        self.token_ids = []
        self.block_hashes = []

"""Prefix caching across KV cache groups: the longest prefix every group can serve.

Each group's pool caches its own blocks under the same chained block hashes
(`kvpool.memory.prefix_cache`), and a group drops and evicts its blocks on its own. A prefix of
j blocks is a usable hit only if, with the next query at position j * block_size:

- every full-attention group holds all j blocks, and
- every sliding-window group holds the blocks that query still reads (`KVGroup.first_live_block`
  to j - 1); the ones before it may be gone, and the hit takes the null block in their place.

That is vLLM's rule for hybrid models. It is checked for every j at once: one lookup per block
and group, tracking for a sliding group the run of cached blocks that ends at each j. A group
evicting a block therefore shortens the hit, it never makes the engine serve a prefix whose KV
some layer lacks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool
from kvpool.memory.kv_groups import KVGroup
from kvpool.memory.prefix_cache import BlockHash, PrefixMatch


@dataclass(frozen=True, slots=True)
class GroupMatch:
    """One `PrefixMatch` per group, all of `num_cached_tokens` tokens."""

    matches: tuple[PrefixMatch, ...]

    @property
    def num_cached_tokens(self) -> int:
        return self.matches[0].num_cached_tokens

    @property
    def num_query_blocks(self) -> int:
        return self.matches[0].num_query_blocks

    @property
    def block_ids(self) -> list[int]:
        """The first group's blocks (what the block statistics and events report)."""
        return self.matches[0].block_ids


def match_groups(groups: Sequence[KVGroup], pools: Sequence[BlockPool],
                 block_hashes: Sequence[BlockHash], token_ids: Sequence[int]) -> GroupMatch:
    """The longest prefix of `token_ids`' full blocks every group can serve (module
    docstring). Pure lookup: no reference taken, no counter touched."""
    size = groups[0].block_size
    num_query = min(len(block_hashes), len(token_ids) // size)
    found = [_lookups(pool, block_hashes, token_ids, num_query, size) for pool in pools]
    num_blocks = num_query
    for group, ids in zip(groups, found, strict=True):
        num_blocks = min(num_blocks, _longest_served(group, ids, num_blocks))
    # A sliding group's shorter hit may have cut a longer full one: check again at the cut.
    while not all(_serves(group, ids, num_blocks)
                  for group, ids in zip(groups, found, strict=True)):
        num_blocks -= 1
    matches = []
    for group, pool, ids in zip(groups, pools, found, strict=True):
        first = group.first_live_block(num_blocks * size)
        block_ids = [NULL_BLOCK_ID] * first + ids[first:num_blocks]
        num_evictable = sum(1 for b in block_ids[first:] if pool.is_evictable(b))
        matches.append(PrefixMatch(block_ids, num_blocks * size, num_evictable, num_query,
                                   len(token_ids)))
    return GroupMatch(tuple(matches))


def _lookups(pool: BlockPool, block_hashes: Sequence[BlockHash], token_ids: Sequence[int],
             num_query: int, size: int) -> list[int | None]:
    """The cached block of each of the first `num_query` blocks, or None."""
    lookup = pool.prefix_cache.lookup
    return [lookup(block_hashes[i], token_ids[i * size:(i + 1) * size]) for i in range(num_query)]


def _serves(group: KVGroup, ids: list[int | None], num_blocks: int) -> bool:
    first = group.first_live_block(num_blocks * group.block_size)
    return all(block_id is not None for block_id in ids[first:num_blocks])


def _longest_served(group: KVGroup, ids: list[int | None], limit: int) -> int:
    """The largest j <= limit whose live blocks this group holds, in one pass: `run` is the
    length of the run of cached blocks ending at block j - 1."""
    best, run = 0, 0
    for j in range(1, limit + 1):
        run = run + 1 if ids[j - 1] is not None else 0
        if j - group.first_live_block(j * group.block_size) <= run:
            best = j
    return best

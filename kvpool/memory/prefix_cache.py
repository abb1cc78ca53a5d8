"""Content hashes of full KV blocks and the map from hash to the block that holds them.

A full block's hash chains on its parent's hash, so equal hashes mean equal *prefixes*, not
just equal blocks. The hashed bytes are three fixed-width fields and the tokens, so no two
different (parent, salt, tokens) triples are the same byte string:

    hash_i = SHA-256( parent      32 bytes: hash_{i-1}, or 32 zero bytes for block 0
                    | salt key    33 bytes: 0x00 + 32 zeros (no salt), or
                                            0x01 + SHA-256(salt, UTF-8)
                    | token ids   4 bytes each, unsigned little-endian )

The salt (a tenant's, or a client's `cache_salt`) is in every block's hash, so requests with
different salts never produce the same hash and never share a block; "no salt" and the empty
salt differ.

What a hit guarantees: the stored block was published under exactly this hash, and its own
token ids equal the query's (compared on every lookup). Earlier blocks are covered by the
chain: handing a request KV computed from other tokens would take a SHA-256 collision between
two different inputs above, which is not known to be feasible.

Invariants of `PrefixCache`:
- `_block_id_by_hash` and `_entry_by_block_id` are inverse maps: a hash names at most one block
  and a block carries at most one hash.
- Only full blocks are inserted; an entry's `token_ids` has exactly `block_size` ids.

`NullPrefixCache` is the same interface with nothing stored: prefix caching switched off.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import KeysView, Sequence
from dataclasses import dataclass

BlockHash = bytes
SaltKey = bytes

_NO_PARENT = bytes(32)
NO_SALT: SaltKey = bytes(33)

# Token ids are packed as unsigned 32-bit little-endian integers; vocabularies stay far below 2**32.
_TOKEN_ITEMSIZE = 4


def _pack_token_ids(token_ids: Sequence[int]) -> bytes:
    packed = array("I", token_ids)
    if packed.itemsize != _TOKEN_ITEMSIZE:  # pragma: no cover - exotic platforms
        packed = array("L", token_ids)
    return packed.tobytes()


def salt_key(cache_salt: str | None) -> SaltKey:
    """The 33 bytes mixed into every block hash of a request (module docstring).

    UnicodeEncodeError (a ValueError) for a salt that is not valid text (a lone surrogate).
    """
    if cache_salt is None:
        return NO_SALT
    return b"\x01" + hashlib.sha256(cache_salt.encode("utf-8")).digest()


def hash_block(
    parent_hash: BlockHash | None, token_ids: Sequence[int], salt: SaltKey = NO_SALT
) -> BlockHash:
    """Hash of one full block chained on its parent's hash (None for the first block)."""
    digest = hashlib.sha256(parent_hash or _NO_PARENT)
    digest.update(salt)
    digest.update(_pack_token_ids(token_ids))
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int],
    block_size: int,
    salt: SaltKey = NO_SALT,
    parent_hash: BlockHash | None = None,
) -> list[BlockHash]:
    """Chained hashes of every full block of `token_ids` (a partial tail is ignored).

    The ids are packed once and sliced per block, which keeps a 4,096-token prompt well under a
    millisecond.
    """
    packed = _pack_token_ids(token_ids)
    block_nbytes = block_size * _TOKEN_ITEMSIZE
    hashes: list[BlockHash] = []
    for start in range(0, (len(token_ids) // block_size) * block_nbytes, block_nbytes):
        digest = hashlib.sha256(parent_hash or _NO_PARENT)
        digest.update(salt)
        digest.update(packed[start : start + block_nbytes])
        parent_hash = digest.digest()
        hashes.append(parent_hash)
    return hashes


@dataclass(frozen=True, slots=True)
class CachedBlock:
    """What the cache knows about one hashed block."""

    block_hash: BlockHash
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a prompt (`BlockPool.match_prefix`): found once when
    admission is planned, taken as it is when the sequence is admitted (`take_prefix`)."""

    block_ids: list[int]
    num_cached_tokens: int
    num_evictable: int  # hits no table holds: reviving them uses allocatable blocks
    num_query_blocks: int  # what was looked up, for the hit-rate counters
    num_query_tokens: int


class PrefixCache:
    """Hash → block id for full blocks whose KV has been computed."""

    def __init__(self) -> None:
        self._block_id_by_hash: dict[BlockHash, int] = {}
        self._entry_by_block_id: dict[int, CachedBlock] = {}
        # A live, read-only view for O(1) membership tests on the pool's free path.
        self.hashed_block_ids = self._entry_by_block_id.keys()

    def __len__(self) -> int:
        return len(self._entry_by_block_id)

    def lookup(self, block_hash: BlockHash, token_ids: Sequence[int]) -> int | None:
        """The block holding exactly these tokens under this hash, or None."""
        block_id = self._block_id_by_hash.get(block_hash)
        if block_id is None:
            return None
        if self._entry_by_block_id[block_id].token_ids != tuple(token_ids):
            return None  # a hash collision within the block: never hand out others' KV
        return block_id

    def insert(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        """Register a full block. Returns False (and stores nothing) when the hash is already
        held by another block or the block already carries a hash."""
        if block_hash in self._block_id_by_hash or block_id in self._entry_by_block_id:
            return False
        self._block_id_by_hash[block_hash] = block_id
        self._entry_by_block_id[block_id] = CachedBlock(block_hash, tuple(token_ids))
        return True

    def remove(self, block_id: int) -> CachedBlock | None:
        """Forget a block's hash (on eviction or migration); returns what was stored."""
        entry = self._entry_by_block_id.pop(block_id, None)
        if entry is not None:
            del self._block_id_by_hash[entry.block_hash]
        return entry

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._entry_by_block_id

    def holds(self, block_hash: BlockHash) -> bool:
        """Whether some block is cached under `block_hash`."""
        return block_hash in self._block_id_by_hash

    def block_hashes(self) -> KeysView[BlockHash]:
        """Every hash cached (a live view: copy it before the cache changes)."""
        return self._block_id_by_hash.keys()

    def entry(self, block_id: int) -> CachedBlock | None:
        """What the cache holds for `block_id`, or None."""
        return self._entry_by_block_id.get(block_id)


class NullPrefixCache(PrefixCache):
    """Prefix caching switched off: stores nothing, finds nothing."""

    def insert(self, block_id: int, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        return False

"""Chained block hashes and the hash → block map."""

from __future__ import annotations

import pytest

from kvpool.memory.prefix_cache import (
    PrefixCache,
        hash_block,
    hash_full_blocks,
    salt_key,
)


def test_hashes_chain_on_the_parent_and_ignore_a_partial_tail():
    tokens = list(range(10))
    hashes = hash_full_blocks(tokens, block_size=4)
    assert len(hashes) == 2
    assert hashes[0] == hash_block(None, tokens[:4])
    assert hashes[1] == hash_block(hashes[0], tokens[4:8])
    # same block content, different parent: different hash
    assert hash_full_blocks(tokens[4:8], 4)[0] != hashes[1]


def test_salt_separates_hashes_and_no_salt_differs_from_empty_salt():
    tokens = [1, 2, 3, 4]
    plain = hash_full_blocks(tokens, 4)[0]
    salted_a = hash_full_blocks(tokens, 4, salt_key("tenant-a"))[0]
    salted_b = hash_full_blocks(tokens, 4, salt_key("tenant-b"))[0]
    empty = hash_full_blocks(tokens, 4, salt_key(""))[0]
    assert len({plain, salted_a, salted_b, empty}) == 4


def test_hashes_are_sha256_sized_and_deterministic():
    first = hash_block(None, [1, 2, 3])
    assert len(first) == 32 and first == hash_block(None, [1, 2, 3])


def test_lookup_compares_token_ids_so_a_collision_returns_nothing():
    cache = PrefixCache()
    assert cache.insert(block_id=3, block_hash=b"h", token_ids=[1, 2])
    assert cache.lookup(b"h", [1, 2]) == 3
    assert cache.lookup(b"h", [9, 9]) is None  # same hash, other tokens: a forced collision
    assert cache.lookup(b"other", [1, 2]) is None


def test_insert_refuses_a_taken_hash_or_a_hashed_block_and_remove_forgets_both():
    cache = PrefixCache()
    assert cache.insert(1, b"h", [1])
    assert not cache.insert(2, b"h", [1])
    assert not cache.insert(1, b"g", [2])
    entry = cache.remove(1)
    assert entry is not None and entry.block_hash == b"h" and entry.token_ids == (1,)
    assert len(cache) == 0 and cache.remove(1) is None
    assert cache.insert(2, b"h", [1])


def test_hash_inputs_are_fixed_width_fields_so_domains_cannot_collide():
    # A salt is hashed to 32 bytes behind a flag, the parent is always 32 bytes: no salt can
    # imitate a parent (or another salt) by its bytes, and no tokens can imitate either.
    tokens = [1, 2, 3, 4]
    parent = hash_block(None, [9, 9, 9, 9])
    assert len(salt_key(None)) == len(salt_key("x")) == 33
    hashes = {
        hash_block(None, tokens),
        hash_block(parent, tokens),
        hash_block(None, tokens, salt_key(parent.decode("latin-1"))),
        hash_block(None, tokens, salt_key("")),
    }
    assert len(hashes) == 4
    assert hash_block(None, [0, 0, 0, 0]) != hash_block(None, [])  # zeros are not "no tokens"


def test_a_salt_that_is_not_text_is_refused():
    with pytest.raises(UnicodeEncodeError):
        salt_key("bad \ud800 salt")

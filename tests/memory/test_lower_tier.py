"""The tier list: the prefix walk takes each block from the first tier of the ordered list
that has it, asks each tier for one finder per lookup, and stops at the first block no tier
has; validation reads tier by tier and cuts the match at the first block a tier fails to
load. The pure core imports nothing from the tiers subpackage."""

from __future__ import annotations

import ast
from pathlib import Path

from kvpool.memory.tiers.lower_tier import LowerTier, StoredRef
from kvpool.memory.tiers.tier_match import LoadedBlock, TierLookup

HASHES = [bytes([index]) * 32 for index in range(5)]
TOKENS = list(range(10))  # block_size 2: five full blocks
PURE_CORE = ("block_pool", "block_table", "prefix_cache", "kv_layout", "kv_cache",
             "kv_listener")


class FakeTier(LowerTier):
    """Holds `held` hashes; loads all but `unreadable` ones (as the block, its hash)."""

    def __init__(self, name: str, held: set[bytes], unreadable: frozenset = frozenset()):
        self.name = name
        self.held = held
        self.unreadable = unreadable
        self.num_lookups = 0

    def start_lookup(self, block_hashes, num_blocks):
        self.num_lookups += 1
        return lambda index, tokens: (StoredRef(self.name, block_hashes[index])
                                      if block_hashes[index] in self.held else None)

    def stats(self):
        return {"num_held": len(self.held)}

    def check_invariants(self):
        assert self.num_lookups >= 0

    def load_run(self, block_hashes, token_ids):
        blocks = []
        for block_hash in block_hashes:
            if block_hash in self.unreadable:
                break
            blocks.append(block_hash)
        return blocks


def test_the_walk_takes_each_block_from_the_nearest_tier_until_none_has_it() -> None:
    near = FakeTier("near", {HASHES[0], HASHES[2], HASHES[4]})
    far = FakeTier("far", {HASHES[1], HASHES[2]})
    match = TierLookup(2, [near, far]).find(HASHES, TOKENS, 0, 5)
    assert match.sources == [StoredRef("near", HASHES[0]), StoredRef("far", HASHES[1]),
                             StoredRef("near", HASHES[2])]
    assert (near.num_lookups, far.num_lookups) == (1, 1)
    assert TierLookup(2, []).find(HASHES, TOKENS, 0, 5).num_blocks == 0


def test_validation_reads_tier_by_tier_and_ends_before_a_failed_block() -> None:
    near = FakeTier("near", {HASHES[0], HASHES[2]}, unreadable=frozenset({HASHES[2]}))
    far = FakeTier("far", {HASHES[1], HASHES[3]})
    lookup = TierLookup(2, [near, far])
    match = lookup.find(HASHES, TOKENS, 0, 5)
    assert match.num_blocks == 4
    lookup.validate(match, TOKENS, 0)
    assert match.sources == [LoadedBlock("near", HASHES[0]), LoadedBlock("far", HASHES[1])]


def test_the_pure_core_imports_nothing_from_the_tiers() -> None:
    memory = Path(__file__).parents[2] / "kvpool" / "memory"
    for name in PURE_CORE:
        tree = ast.parse((memory / f"{name}.py").read_text(encoding="utf-8"))
        modules = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        modules |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                    for alias in node.names}
        assert not any(m and m.startswith("kvpool.memory.tiers") for m in modules), name

"""PrefixIndex: per-tier membership from KV event batches, against a plain model."""

from __future__ import annotations

import threading

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.formats.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from kvpool.router.prefix_index import PrefixIndex

H = [bytes([i]) * 32 for i in range(8)]


def stored(hashes: list[bytes], medium: str | None = "device") -> BlockStored:
    return BlockStored(hashes, None, [0] * (4 * len(hashes)), 4, None, medium)


def batch(*events) -> KVEventBatch:
    return KVEventBatch(0.0, list(events))


def test_longest_prefix_stops_at_the_first_missing_hash() -> None:
    index = PrefixIndex()
    index.apply(batch(stored([H[0], H[1], H[3]])))
    assert index.longest_prefix([H[0], H[1], H[2], H[3]]) == 2
    assert index.longest_prefix([H[0], H[1]]) == 2
    assert index.longest_prefix([H[1], H[0]]) == 2
    assert index.longest_prefix([H[2], H[0]]) == 0
    assert index.longest_prefix([]) == 0


def test_a_block_in_both_tiers_counts_once_and_outlives_one_removal() -> None:
    index = PrefixIndex()
    index.apply(batch(stored([H[0], H[1]]), stored([H[0]], "host")))
    assert len(index) == 2
    index.apply(batch(BlockRemoved([H[0]], "device")))
    assert len(index) == 2 and index.longest_prefix([H[0], H[1]]) == 2
    assert index.blocks() == {(H[0], "host"), (H[1], "device")}
    index.apply(batch(BlockRemoved([H[0], H[5]], "host")))  # H[5]: never held, ignored
    assert index.blocks() == {(H[1], "device")}


def test_all_blocks_cleared_replace_and_clear() -> None:
    index = PrefixIndex()
    index.apply(batch(stored([H[0]]), AllBlocksCleared(), stored([H[1]], "host")))
    assert index.blocks() == {(H[1], "host")}
    index.replace([(H[2], "device"), (H[2], "host"), (H[3], "host")])
    assert len(index) == 2 and index.blocks() == {(H[2], "device"), (H[2], "host"),
                                                  (H[3], "host")}
    index.clear()
    assert len(index) == 0 and index.longest_prefix([H[2]]) == 0


def test_a_missing_medium_counts_as_the_device() -> None:
    index = PrefixIndex()
    index.apply(batch(stored([H[0]], None)))
    index.apply(batch(BlockRemoved([H[0]], "device")))
    assert len(index) == 0


def test_readers_see_whole_batches() -> None:
    """A reader on another thread sees a batch of stores all or not at all."""
    index = PrefixIndex()
    chain = [bytes([i, j]) * 16 for i in range(4) for j in range(50)]
    seen: list[int] = []
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.append(index.longest_prefix(chain))

    reader = threading.Thread(target=read)
    reader.start()
    for _ in range(200):
        index.apply(batch(stored(chain)))
        index.apply(batch(BlockRemoved(chain, "device")))
    done.set()
    reader.join()
    assert set(seen) <= {0, len(chain)}


MEDIUMS = ("device", "host")
hashes = st.lists(st.sampled_from(H), min_size=1, max_size=4)


class IndexMachine(RuleBasedStateMachine):
    """Random batches, snapshots and clears; the model is a set of hashes per medium."""

    def __init__(self) -> None:
        super().__init__()
        self.index = PrefixIndex()
        self.model: dict[str, set[bytes]] = {medium: set() for medium in MEDIUMS}

    @rule(events=st.lists(st.tuples(st.sampled_from(("stored", "removed", "cleared")),
                                    hashes, st.sampled_from(MEDIUMS)), max_size=5))
    def apply(self, events) -> None:
        wire = []
        for kind, block_hashes, medium in events:
            if kind == "stored":
                wire.append(stored(block_hashes, medium))
                self.model[medium] |= set(block_hashes)
            elif kind == "removed":
                wire.append(BlockRemoved(block_hashes, medium))
                self.model[medium] -= set(block_hashes)
            else:
                wire.append(AllBlocksCleared())
                for held in self.model.values():
                    held.clear()
        self.index.apply(batch(*wire))

    @rule(blocks=st.lists(st.tuples(st.sampled_from(H), st.sampled_from(MEDIUMS)),
                          max_size=10))
    def replace(self, blocks) -> None:
        self.index.replace(blocks)
        self.model = {medium: {h for h, m in blocks if m == medium} for medium in MEDIUMS}

    @rule()
    def clear(self) -> None:
        self.index.clear()
        self.model = {medium: set() for medium in MEDIUMS}

    @rule(query=st.lists(st.sampled_from(H), max_size=6))
    def longest_prefix(self, query) -> None:
        held = set().union(*self.model.values())
        expected = next((i for i, h in enumerate(query) if h not in held), len(query))
        assert self.index.longest_prefix(query) == expected

    @invariant()
    def same_blocks(self) -> None:
        held = set().union(*self.model.values())
        assert len(self.index) == len(held)
        assert self.index.blocks() == {(h, m) for m, hs in self.model.items() for h in hs}


TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)

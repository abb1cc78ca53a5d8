"""The resizable block pool: ids brought online and taken offline, relocation, reset.

Small scenarios assert exact ids (id 0 is the null block: never online); a property test
interleaves sequence operations with segments of ids going online, offline, and being emptied
by relocation, and watches that an id's generation moves exactly when the id stops naming its
KV (handed out, relocated away, taken offline).
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from pool_checks import (
    assert_cached_blocks_hold_table_tokens,
    assert_generations_moved_exactly,
    generations,
)

from kvpool.memory.errors import InvalidBlockError, OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.resizable_block_pool import ResizableBlockPool
from kvpool.memory.sequence_blocks import SequenceBlocks


def make_pool(online: range | list[int], capacity_blocks: int, block_size: int = 4):
    pool = ResizableBlockPool(capacity_blocks, KVLayout(block_size))
    pool.add_blocks(online)
    return pool


def test_a_pool_can_start_empty_and_take_ids_online():
    pool = ResizableBlockPool(12, KVLayout(4))
    assert pool.num_blocks == 0 and pool.num_allocatable_blocks == 0
    assert pool.stats().usage == 0.0
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    pool.add_blocks(range(4, 8))
    assert pool.num_blocks == 4 and pool.online_block_ids() == [4, 5, 6, 7]
    assert pool.allocate(2) == [4, 5]
    pool.check_invariants()


def test_added_blocks_go_under_the_blocks_already_free():
    pool = make_pool(range(1, 5), 9)
    pool.free(pool.allocate(3))  # LIFO: 3, 2, 1 come back first, then 4
    pool.add_blocks([8, 7, 6, 5])
    assert pool.free_block_ids() == [3, 2, 1, 4, 5, 6, 7, 8]


def test_offline_ids_are_never_handed_out_or_accepted():
    pool = make_pool(range(1, 5), 9)
    assert pool.allocate(4) == [1, 2, 3, 4]
    with pytest.raises(OutOfBlocksError):
        pool.allocate(1)
    for call in (pool.free, pool.retain):
        with pytest.raises(InvalidBlockError, match="does not exist"):
            call([6])
    with pytest.raises(InvalidBlockError, match="does not exist"):
        pool.ref_count(6)
    assert not pool.is_online(6) and not pool.is_online(9) and pool.is_online(4)


def test_add_rejects_online_repeated_out_of_range_and_null_ids_without_change():
    pool = make_pool(range(1, 5), 9)
    for bad in ([4], [6, 6], [9], [-1], [0], [True]):
        with pytest.raises(InvalidBlockError):
            pool.add_blocks(bad)
    assert pool.num_blocks == 4 and pool.online_block_ids() == [1, 2, 3, 4]
    pool.check_invariants()


def test_remove_takes_free_and_cached_blocks_offline_and_refuses_used_ones():
    pool = make_pool(range(1, 7), 7, block_size=2)
    table = SequenceBlocks(pool)
    table.append_tokens([1, 2, 3, 4, 5])  # blocks 1, 2 full (hashed), 3 partial
    with pytest.raises(InvalidBlockError, match="it is used"):
        pool.remove_blocks([4, 3])
    assert pool.num_blocks == 6, "a refused removal changes nothing"
    table.free()  # 1 and 2 stay cached, 3 is free
    assert pool.evictable_block_ids() == [2, 1]
    assert pool.remove_blocks([1, 3, 6]) == 1  # one cached block evicted
    assert pool.online_block_ids() == [2, 4, 5]
    assert pool.evictable_block_ids() == [2] and pool.free_block_ids() == [4, 5]
    assert not pool.prefix_cache.is_cached(1) and pool.stats().num_evictions == 1
    pool.check_invariants()


def test_relocate_moves_references_filled_slots_and_the_prefix_cache_entry():
    pool = make_pool(range(1, 9), 9, block_size=2)
    writer = SequenceBlocks(pool)
    writer.append_tokens([1, 2, 3, 4, 5])  # blocks 1, 2 (hashed), 3 (1 of 2 slots)
    reader = writer.fork()
    pool.remove_blocks([4, 5])  # so the new ids are visibly the next free ones: 6, 7, 8
    old_to_new = pool.relocate_blocks([1, 2, 3])
    assert old_to_new == {1: 6, 2: 7, 3: 8}
    assert writer.remap(old_to_new) == 3 and reader.remap(old_to_new) == 3
    assert writer.block_ids == reader.block_ids == [6, 7, 8]
    assert [pool.ref_count(b) for b in (6, 7, 8)] == [2, 2, 2]
    assert sorted(pool.free_block_ids()) == [1, 2, 3] and pool.stats().num_unfilled_slots == 1
    assert pool.prefix_cache.lookup(writer.block_hashes[1], [3, 4]) == 7
    assert not pool.prefix_cache.is_cached(2)
    pool.check_invariants()
    writer.free()
    reader.free()
    assert SequenceBlocks(pool).take_cached_prefix([1, 2, 3, 4, 9]) == 4  # hits at 6 and 7


def test_relocation_and_going_offline_advance_generations_and_going_online_does_not():
    pool = make_pool(range(1, 5), 5, block_size=2)
    table = SequenceBlocks(pool)
    table.append_tokens([1, 2, 3])  # blocks 1, 2
    pool.remove_blocks([3])
    assert [pool.generation(b) for b in (1, 2, 3, 4)] == [1, 1, 1, 0]
    assert pool.relocate_blocks([1]) == {1: 4}
    assert (pool.generation(1), pool.generation(4)) == (2, 1)  # moved away; taken
    pool.add_blocks([3])
    assert pool.generation(3) == 1
    pool.check_invariants()


def test_relocate_is_all_or_nothing():
    pool = make_pool(range(1, 5), 5, block_size=2)
    table = SequenceBlocks(pool)
    table.append_tokens([1, 2, 3, 4, 5, 6])  # blocks 1, 2, 3
    with pytest.raises(OutOfBlocksError):
        pool.relocate_blocks([1, 2])
    with pytest.raises(InvalidBlockError, match="not used"):
        pool.relocate_blocks([1, 4])
    assert pool.free_block_ids() == [4] and table.block_ids == [1, 2, 3]
    pool.check_invariants()


def test_reset_makes_a_quiescent_pool_look_new():
    pool = make_pool(range(1, 5), 7, block_size=2)
    pool.add_blocks([6])
    table = SequenceBlocks(pool)
    table.append_tokens([1, 2, 3, 4, 5])
    with pytest.raises(InvalidBlockError, match="used blocks"):
        pool.reset()
    table.free()
    pool.reset()
    assert pool.free_block_ids() == [1, 2, 3, 4, 6] and pool.num_cached_blocks == 0
    assert len(pool.prefix_cache) == 0
    stats = pool.stats()
    assert (stats.num_allocations, stats.num_frees, stats.num_evictions) == (0, 0, 0)
    pool.check_invariants()


# ------------------------------------------------------------------ property test
BLOCK_SIZE = 2
SEGMENT_BLOCKS = 4
NUM_SEGMENTS = 4
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=6)
SEGMENTS = st.integers(min_value=0, max_value=NUM_SEGMENTS - 1)


def _segment_ids(segment: int) -> list[int]:
    first = 1 + segment * SEGMENT_BLOCKS  # after the null block
    return list(range(first, first + SEGMENT_BLOCKS))


class MoveLog(ResizableBlockPool):
    """A resizable pool that notes each id that stops naming its KV: the generation oracle."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.moved: set[int] = set()

    def allocate(self, num_blocks: int) -> list[int]:
        block_ids = super().allocate(num_blocks)
        self.moved.update(block_ids)
        return block_ids

    def relocate_blocks(self, block_ids):
        old_to_new = super().relocate_blocks(block_ids)
        self.moved.update(old_to_new, old_to_new.values())
        return old_to_new

    def remove_blocks(self, block_ids, is_kv_intact=False):
        block_ids = list(block_ids)
        num_evicted = super().remove_blocks(block_ids, is_kv_intact)
        self.moved.update(block_ids)
        return num_evicted


class OnlineBlockPoolMachine(RuleBasedStateMachine):
    """Tables grow, fork and free while segments of ids go online, offline, or are emptied
    by relocation (as an elastic pool does); the tables always read the tokens they wrote."""

    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.pool = MoveLog(1 + SEGMENT_BLOCKS * NUM_SEGMENTS, KVLayout(BLOCK_SIZE))
        self.pool.add_blocks(_segment_ids(0) + _segment_ids(1))
        self.generations = generations(self.pool)
        self.online = {0, 1}
        self.tables: dict[int, SequenceBlocks] = {}
        self.expected: dict[int, list[int]] = {}
        self.next_id = 0

    @rule(target=sequences, tokens=TOKENS)
    def new_sequence(self, tokens):
        table = SequenceBlocks(self.pool)
        table.take_cached_prefix(tokens)
        try:
            table.append_tokens(tokens[table.num_tokens :])
        except OutOfBlocksError:
            table.free()
            return None
        self.next_id += 1
        self.tables[self.next_id], self.expected[self.next_id] = table, list(tokens)
        return self.next_id

    @rule(seq=sequences, tokens=TOKENS)
    def append(self, seq, tokens):
        if seq in self.tables:
            try:
                self.tables[seq].append_tokens(tokens)
                self.expected[seq].extend(tokens)
            except OutOfBlocksError:
                pass

    @rule(target=sequences, seq=sequences)
    def fork(self, seq):
        if seq not in self.tables:
            return None
        self.next_id += 1
        self.tables[self.next_id] = self.tables[seq].fork()
        self.expected[self.next_id] = list(self.expected[seq])
        return self.next_id

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq in self.tables:
            self.tables.pop(seq).free()
            del self.expected[seq]

    @rule(segment=SEGMENTS)
    def add_segment(self, segment):
        if segment in self.online:
            with pytest.raises(InvalidBlockError):
                self.pool.add_blocks(_segment_ids(segment))
            return
        self.pool.add_blocks(_segment_ids(segment))
        self.online.add(segment)

    @rule(segment=SEGMENTS)
    def remove_segment(self, segment):
        """Succeeds iff no id of the segment is used; a refusal changes nothing."""
        ids = _segment_ids(segment)
        is_used = segment in self.online and any(self.pool.ref_count(b) for b in ids)
        before = self.pool.online_block_ids()
        if segment not in self.online or is_used:
            with pytest.raises(InvalidBlockError):
                self.pool.remove_blocks(ids)
            assert self.pool.online_block_ids() == before
            return
        self.pool.remove_blocks(ids)
        self.online.discard(segment)

    @precondition(lambda self: self.online)
    @rule(data=st.data())
    def migrate_segment(self, data):
        """Empty an online segment by relocating its used blocks, then take it offline."""
        segment = data.draw(st.sampled_from(sorted(self.online)))
        ids = _segment_ids(segment)
        used = [b for b in ids if self.pool.ref_count(b)]
        if self.pool.num_allocatable_blocks < SEGMENT_BLOCKS:
            return
        self.pool.remove_blocks([b for b in ids if not self.pool.ref_count(b)])
        old_to_new = self.pool.relocate_blocks(used)
        assert not set(old_to_new.values()) & set(ids)
        num_remapped = sum(table.remap(old_to_new) for table in self.tables.values())
        assert num_remapped == sum(self.pool.ref_count(b) for b in old_to_new.values())
        self.pool.remove_blocks(used)
        self.online.discard(segment)

    @invariant()
    def pool_invariants_hold(self):
        self.pool.check_invariants()
        online = sorted(b for segment in self.online for b in _segment_ids(segment))
        assert self.pool.online_block_ids() == online
        stats = self.pool.stats()
        assert stats.num_free_blocks + stats.num_cached_blocks + stats.num_used_blocks == len(
            online
        )

    @invariant()
    def generations_move_iff_ids_stop_naming_their_kv(self):
        after = generations(self.pool)
        assert_generations_moved_exactly(self.generations, after, self.pool.moved)
        self.generations = after
        self.pool.moved.clear()

    @invariant()
    def ref_counts_equal_owners_and_tables_hold_their_tokens(self):
        owners = Counter(b for table in self.tables.values() for b in table.block_ids)
        assert all(self.pool.is_online(b) for b in owners), "a table holds an offline id"
        for block_id in self.pool.online_block_ids():
            assert self.pool.ref_count(block_id) == owners[block_id]
        for seq, table in self.tables.items():
            assert table.token_ids == self.expected[seq]
        assert_cached_blocks_hold_table_tokens(self.pool, self.tables.values())


OnlineBlockPoolMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=30, deadline=None
)
TestOnlineBlockPoolMachine = OnlineBlockPoolMachine.TestCase

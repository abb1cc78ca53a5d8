"""The elastic KV pool without a model: segments from the arena, growth, migration, policy.

A tiny KV cache (256 bytes per block) over an arena of the null block and 16 blocks, segments
of 4 blocks (ids 1..4, 5..8, ...). Data is written into blocks by hand so that a migration can
be checked tensor for tensor.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, rule

from kvpool.memory.arena import Arena
from kvpool.memory.block_leases import BlockLeases
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.elastic_pool import ElasticKVPool, ElasticPoolConfig
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_pool import StaticKVPool
from kvpool.memory.resizable_block_pool import ResizableBlockPool
from kvpool.memory.sequence_blocks import SequenceBlocks

BLOCK_SIZE = 2
LAYOUT = KVLayout(BLOCK_SIZE, num_layers=2, num_kv_heads=1, head_dim=8)
BYTES_PER_BLOCK = LAYOUT.bytes_per_block  # 256
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=12)


# int8 codes with a float32 scale per (token, KV head) in the scale pool beside the arena.
QUANTIZED_LAYOUT = KVLayout(BLOCK_SIZE, num_layers=2, num_kv_heads=1, head_dim=8, dtype="int8")


def make_elastic(num_blocks: int = 16, layout: KVLayout = LAYOUT, **options) -> ElasticKVPool:
    """An elastic pool that can bring `num_blocks` blocks online (the arena also holds the
    null block)."""
    options = {"segment_blocks": 4, "initial_blocks": 4, "idle_seconds": 0.0} | options
    arena = Arena.reserve((num_blocks + 1) * layout.kv_bytes_per_block)
    arena.buffer.fill_(0xFF)  # what stale memory may hold (NaN as float32)
    kv_cache = KVCache(layout, num_blocks + 1, storage=arena.buffer)
    pool = ResizableBlockPool(num_blocks + 1, layout)
    return ElasticKVPool(pool, kv_cache, arena, ElasticPoolConfig(**options))


def write_table(elastic: ElasticKVPool, tokens: list[int]) -> SequenceBlocks:
    """A table holding `tokens`, its blocks filled with data unique to each block."""
    table = SequenceBlocks(elastic.pool)
    table.append_tokens(tokens)
    for block_id in table.block_ids:
        elastic.kv_cache.tensor[block_id] = torch.randn(elastic.kv_cache.tensor.shape[1:])
    return table


def test_segments_come_online_zeroed_until_the_budget_is_spent():
    elastic = make_elastic()
    tensor = elastic.kv_cache.tensor
    assert [s.first_block_id for s in elastic.segments] == [1]
    assert elastic.pool.online_block_ids() == [1, 2, 3, 4]
    assert [elastic.grow() for _ in range(4)] == [True, True, True, False]
    assert [s.first_block_id for s in elastic.segments] == [1, 5, 9, 13]
    assert elastic.pool.num_blocks == elastic.max_num_blocks == 16
    assert torch.count_nonzero(tensor) == 0, "every online block (and the null block) is zero"
    stats = elastic.stats()
    assert (stats.num_grows, stats.num_segments, stats.num_online_blocks) == (3, 4, 16)
    assert stats.arena.num_allocated_bytes == 17 * BYTES_PER_BLOCK  # the null block too
    assert stats.arena.num_free_bytes == 0
    elastic.check_invariants()


def test_offline_blocks_keep_their_bytes_but_the_null_block_is_zero():
    elastic = make_elastic(initial_blocks=0)
    tensor = elastic.kv_cache.tensor
    assert elastic.pool.num_blocks == 0 and elastic.segments == []
    assert torch.count_nonzero(tensor[0]) == 0, "the null block pads every block table"
    assert bool(tensor[1:].isnan().all())


def test_initial_blocks_round_up_to_whole_segments_and_must_fit():
    assert make_elastic(initial_blocks=5).pool.num_blocks == 8
    assert make_elastic(initial_blocks=None).pool.num_blocks == 4  # one segment by default
    assert make_elastic(initial_blocks=None, segment_blocks=64).pool.num_blocks == 16
    with pytest.raises(ValueError, match="exceeds"):
        make_elastic(initial_blocks=17)


def test_the_last_segment_takes_what_is_left():
    elastic = make_elastic(num_blocks=10)
    while elastic.grow():
        pass
    assert [s.num_blocks for s in elastic.segments] == [4, 4, 2]
    assert elastic.max_num_blocks == 10


def test_shrink_migrates_used_blocks_and_their_data_survives():
    elastic = make_elastic(initial_blocks=12)
    left = write_table(elastic, list(range(7)))  # blocks 1..4: all of segment 0
    middle = write_table(elastic, [9] * 6)  # blocks 5, 6, 7
    right = write_table(elastic, [5, 6, 7])  # blocks 8 (segment 1) and 9 (segment 2)
    shared = right.fork()
    middle.free()  # 5, 6, 7 stay cached: segments 1 and 2 now hold one used block each
    tables = [left, right, shared]
    before = [elastic.kv_cache.tensor[table.block_ids].clone() for table in tables]
    assert elastic.shrink(tables)  # a tie: the highest segment goes
    assert [s.first_block_id for s in elastic.segments] == [1, 5]
    # Block 9 moved into the least recently used cached block (7), evicting its prefix.
    assert right.block_ids == shared.block_ids == [8, 7]
    assert elastic.pool.ref_count(7) == 2
    for table, data in zip(tables, before, strict=True):
        assert torch.equal(elastic.kv_cache.tensor[table.block_ids], data)
    stats = elastic.stats()
    assert (stats.num_shrinks, stats.num_migrated_blocks, stats.num_online_blocks) == (1, 1, 8)
    assert stats.arena.num_live_allocations == 3  # the null block and two segments
    assert stats.arena.num_free_bytes == 8 * BYTES_PER_BLOCK
    elastic.check_invariants()


def test_shrink_evicts_unreferenced_cached_blocks_and_moves_held_prefixes():
    elastic = make_elastic(initial_blocks=4)
    holder = write_table(elastic, [1, 2])  # block 1: full, so hashed
    filler = write_table(elastic, [3, 4, 5, 6, 7, 8])  # blocks 2..4, hashed
    assert elastic.grow()
    other = write_table(elastic, [7, 7, 7])  # blocks 5, 6 of segment 1
    filler.free()  # segment 0: one used block, three cached ones
    data = elastic.kv_cache.tensor[1].clone()
    assert elastic.shrink([holder, other])
    assert [s.first_block_id for s in elastic.segments] == [5]
    assert holder.block_ids[0] in (7, 8)
    assert elastic.stats().num_evicted_blocks == 3
    assert elastic.pool.match_prefix(holder.prefix_hashes([3, 4]), [3, 4]).block_ids == []
    holder.free()
    reader = SequenceBlocks(elastic.pool)
    assert reader.take_cached_prefix([1, 2, 9]) == 2  # the moved block still serves [1, 2]
    assert torch.equal(elastic.kv_cache.tensor[reader.block_ids[0]], data)
    elastic.check_invariants()


def test_shrink_refuses_when_the_other_segments_lack_room():
    elastic = make_elastic(initial_blocks=8)
    table = write_table(elastic, list(range(9)))  # blocks 1..5: 3 blocks free in all
    assert elastic.shrink([table]) is False
    assert elastic.pool.num_blocks == 8 and table.block_ids == [1, 2, 3, 4, 5]
    assert make_elastic(initial_blocks=0).shrink([]) is False


def test_shrink_refuses_tables_that_miss_a_reference_and_changes_nothing():
    elastic = make_elastic(initial_blocks=8)
    full = write_table(elastic, list(range(8)))  # segment 0
    table = write_table(elastic, [1, 2, 3])  # blocks 5, 6: segment 1 is the emptiest
    fork = table.fork()
    with pytest.raises(ValueError, match="every live block table"):
        elastic.shrink([full, table])  # the fork also holds blocks 5 and 6
    assert elastic.pool.num_blocks == 8 and fork.block_ids == table.block_ids == [5, 6]
    elastic.check_invariants()


def test_a_leased_block_pins_its_segment_a_shrink_moves_nothing():
    """A lease's reference is no table's, so shrink refuses to relocate the block (the
    remote reader would otherwise pull an id that no longer holds its KV)."""
    elastic = make_elastic(initial_blocks=8)
    full = write_table(elastic, list(range(8)))  # segment 0
    table = write_table(elastic, [1, 2, 3])  # blocks 5, 6: segment 1 is the emptiest
    leases = BlockLeases(elastic.pool, ttl_seconds=5.0)
    lease = leases.lease("to-decode", table.block_ids, now=0.0)
    table.free()
    with pytest.raises(ValueError, match="every live block table"):
        elastic.shrink([full])
    assert elastic.pool.num_blocks == 8 and leases.check("to-decode", lease.pairs, 1.0)
    leases.release("to-decode")
    assert elastic.shrink([full]) is True
    elastic.check_invariants()


def test_policy_grows_under_the_watermark_and_shrinks_after_a_continuous_idle_time():
    elastic = make_elastic(initial_blocks=4, idle_seconds=5.0, low_watermark_blocks=1)
    busy = write_table(elastic, list(range(8)))  # all 4 blocks
    elastic.maybe_resize(0.0, [busy])
    assert elastic.pool.num_blocks == 8 and elastic.stats().num_grows == 1
    busy.free()  # 8 allocatable >= one segment + the watermark: the idle clock starts
    elastic.maybe_resize(10.0, [])
    elastic.maybe_resize(14.0, [])
    burst = write_table(elastic, list(range(20, 28)))  # 4 allocatable: the clock restarts
    elastic.maybe_resize(14.5, [burst])
    burst.free()
    elastic.maybe_resize(16.0, [])
    elastic.maybe_resize(20.9, [])
    assert elastic.pool.num_blocks == 8
    elastic.maybe_resize(21.0, [])
    assert elastic.pool.num_blocks == 4 and elastic.stats().num_shrinks == 1
    elastic.maybe_resize(100.0, [])  # the initial segment is the floor
    assert elastic.pool.num_blocks == 4


def test_policy_gives_back_one_segment_per_idle_period_down_to_the_initial_blocks():
    elastic = make_elastic(initial_blocks=4, idle_seconds=1.0)
    assert elastic.grow() and elastic.grow()
    online = []
    for now in (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0):
        elastic.maybe_resize(now, [])
        online.append(elastic.pool.num_blocks)
    assert online == [12, 12, 8, 8, 4, 4, 4, 4]
    lazy = make_elastic(initial_blocks=0)
    assert lazy.grow()
    lazy.maybe_resize(0.0, [])
    assert lazy.pool.num_blocks == 0, "a lazy pool gives everything back"


def test_reset_gives_back_segments_grown_since_start_and_zeroes_counters():
    elastic = make_elastic(initial_blocks=4)
    assert elastic.grow() and elastic.grow()
    table = write_table(elastic, list(range(12)))
    table.free()
    elastic.reset()
    assert [s.first_block_id for s in elastic.segments] == [1]
    assert elastic.pool.free_block_ids() == [1, 2, 3, 4] and elastic.pool.num_cached_blocks == 0
    stats = elastic.stats()
    assert (stats.num_grows, stats.num_shrinks, stats.num_migrated_blocks) == (0, 0, 0)
    assert elastic.pool.stats().num_allocations == 0
    used = write_table(elastic, [1])
    with pytest.raises(ValueError):
        elastic.reset()
    used.free()


def test_the_policy_never_shrinks_below_the_initial_blocks_past_a_short_segment():
    elastic = make_elastic(num_blocks=10, initial_blocks=8)  # segments 1..4, 5..8
    big = write_table(elastic, list(range(16)))  # blocks 1..8
    assert elastic.grow() and [s.num_blocks for s in elastic.segments] == [4, 4, 2]
    small = write_table(elastic, [1, 2])  # block 9, in the short segment
    big.free()  # the initial segments hold only cached blocks now: the emptiest
    for now in (0.0, 1.0, 2.0, 3.0):
        elastic.maybe_resize(now, [small])
    assert elastic.pool.num_blocks == 8, "the floor is 8 blocks, not 2 segments"
    assert [s.first_block_id for s in elastic.segments] == [1, 5]
    assert small.block_ids[0] in range(1, 9)
    elastic.check_invariants()


def test_reset_restores_the_start_up_state_even_after_an_initial_segment_went():
    elastic = make_elastic(initial_blocks=8)
    start = (elastic.pool.online_block_ids(), elastic.pool.free_block_ids(),
             elastic.arena.free_ranges())
    assert elastic.grow()
    filler = write_table(elastic, list(range(16)))  # blocks 1..8
    held = write_table(elastic, [1, 2])  # block 9, in the grown segment
    filler.free()
    assert elastic.shrink([held])  # an initial segment goes: a tie, the higher one
    assert [s.first_block_id for s in elastic.segments] == [1, 9]
    held.free()
    elastic.reset()
    assert [s.first_block_id for s in elastic.segments] == [1, 5]
    assert (elastic.pool.online_block_ids(), elastic.pool.free_block_ids(),
            elastic.arena.free_ranges()) == start
    elastic.check_invariants()


def test_static_pool_is_the_null_object():
    arena = Arena.reserve(9 * BYTES_PER_BLOCK)  # 8 blocks and the null block
    handle = arena.allocate(9 * BYTES_PER_BLOCK, alignment=BYTES_PER_BLOCK)
    storage = arena.buffer[handle.offset : handle.offset + handle.nbytes]
    storage.view(torch.float32).fill_(float("nan"))
    kv_cache = KVCache(LAYOUT, 9, storage=storage)
    static = StaticKVPool(BlockPool(8, LAYOUT), kv_cache, arena)
    assert torch.count_nonzero(kv_cache.tensor) == 0
    table = SequenceBlocks(static.pool)
    table.append_tokens(list(range(16)))
    assert static.grow() is False and static.shrink([table]) is False
    static.maybe_resize(1e9, [table])
    stats = static.stats()
    assert (stats.mode, stats.num_online_blocks, stats.max_num_blocks) == ("static", 8, 8)
    assert (stats.num_grows, stats.num_shrinks, stats.arena.num_free_bytes) == (0, 0, 0)


# ------------------------------------------------------------------ property test
def token_value(tokens: list[int], position: int) -> float:
    """The 'KV' a token gets: a function of its whole prefix, as a model's KV is."""
    return float(hash(tuple(tokens[: position + 1])) % 100_003)


class ElasticPoolMachine(RuleBasedStateMachine):
    """Sequences write KV while the pool grows, shrinks and resizes under its policy; every
    table must always read back the values of its own tokens."""

    sequences = Bundle("sequences")
    layout = LAYOUT

    def __init__(self) -> None:
        super().__init__()
        self.elastic = make_elastic(
            num_blocks=16, layout=self.layout, segment_blocks=4, initial_blocks=0,
            low_watermark_blocks=1,
        )
        self.tables: dict[int, SequenceBlocks] = {}
        self.tokens: dict[int, list[int]] = {}
        self.next_id = 0
        self.now = 0.0

    def _append(self, seq: int, table: SequenceBlocks, new_tokens: list[int]) -> bool:
        start = table.num_tokens
        while True:  # as the engine's KV manager does: grow before giving up
            try:
                copies = table.append_tokens(new_tokens)
                break
            except OutOfBlocksError:
                if not self.elastic.grow():
                    return False
        self.elastic.kv_cache.copy_blocks(copies)  # copy-on-write, before any new write
        self.tokens[seq] += new_tokens
        kv_cache = self.elastic.kv_cache
        for position in range(start, table.num_tokens):
            slot = LAYOUT.slot(table.block_ids, position)
            value = token_value(self.tokens[seq], position)
            block_id, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
            if kv_cache.scales is None:
                kv_cache.tensor[block_id][:, :, offset] = value
            else:  # a code and a scale, both a function of the prefix: both must move
                kv_cache.tensor[block_id][:, :, offset] = int(value) % 127
                kv_cache.scales[block_id][:, :, offset] = value
        return True

    @rule(target=sequences, tokens=TOKENS)
    def new_sequence(self, tokens):
        seq = self.next_id = self.next_id + 1
        table = SequenceBlocks(self.elastic.pool)
        table.take_cached_prefix(tokens)
        self.tokens[seq] = list(tokens[: table.num_tokens])
        if not self._append(seq, table, tokens[table.num_tokens :]):
            table.free()
            del self.tokens[seq]
            return None
        self.tables[seq] = table
        return seq

    @rule(seq=sequences, tokens=TOKENS)
    def append(self, seq, tokens):
        if seq in self.tables:
            self._append(seq, self.tables[seq], tokens)

    @rule(target=sequences, seq=sequences)
    def fork(self, seq):
        if seq not in self.tables:
            return None
        child = self.next_id = self.next_id + 1
        self.tables[child] = self.tables[seq].fork()
        self.tokens[child] = list(self.tokens[seq])
        return child

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq in self.tables:
            self.tables.pop(seq).free()
            del self.tokens[seq]

    @rule(token=st.integers(min_value=3, max_value=5))
    def fragment(self, token):
        """One-block tables in every free block, then every other one freed: holes in every
        segment, the state in which a shrink has to migrate."""
        singles = []
        while self.elastic.pool.num_allocatable_blocks or self.elastic.grow():
            seq = self.next_id = self.next_id + 1
            self.tables[seq], self.tokens[seq] = SequenceBlocks(self.elastic.pool), []
            self._append(seq, self.tables[seq], [token, seq])
            singles.append(seq)
        for seq in singles[::2]:
            self.tables.pop(seq).free()
            del self.tokens[seq]

    @rule()
    def grow(self):
        self.elastic.grow()

    @rule()
    def shrink(self):
        self.elastic.shrink(self.tables.values())

    @rule(seconds=st.sampled_from([0.0, 0.5, 2.0]))
    def resize(self, seconds):
        self.now += seconds
        self.elastic.maybe_resize(self.now, self.tables.values())

    @invariant()
    def every_table_reads_its_own_values(self):
        self.elastic.check_invariants()
        kv_cache = self.elastic.kv_cache
        for seq, table in self.tables.items():
            assert table.token_ids == self.tokens[seq]
            for position in range(table.num_tokens):
                slot = LAYOUT.slot(table.block_ids, position)
                block_id, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
                value = token_value(self.tokens[seq], position)
                code = kv_cache.tensor[block_id, 0, 1, offset, 0, 0].item()
                if kv_cache.scales is None:
                    assert code == value
                else:
                    assert code == int(value) % 127
                    assert kv_cache.scales[block_id, 0, 1, offset, 0].item() == value


class QuantizedElasticPoolMachine(ElasticPoolMachine):
    """The same, over int8 codes: every copy-on-write and migration moves the scales too."""

    layout = QUANTIZED_LAYOUT


for machine in (ElasticPoolMachine, QuantizedElasticPoolMachine):
    machine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
TestElasticPoolMachine = ElasticPoolMachine.TestCase
TestQuantizedElasticPoolMachine = QuantizedElasticPoolMachine.TestCase

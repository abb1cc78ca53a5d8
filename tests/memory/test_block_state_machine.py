"""Property test: random interleavings of sequence operations keep every pool invariant.

A shadow model (the token ids each live sequence should hold) runs beside the real block
tables; after every step the pool's bookkeeping is checked against the tables that exist.
Speculative decoding's steps are among the operations: `draft` gives a sequence tentative
slots, `commit` keeps a prefix of them (the accepted drafts) and drops the rest; between the
two the sequence is only verified, as in the engine's step (no append, fork or draft).
Generations are watched too: a block's changes iff `allocate` handed it out for new content
since the last look (a prefix hit's revival and a fork's retain keep it), and never goes down.
"""

from __future__ import annotations

from collections import Counter, defaultdict

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
    assert_view_matches_pool,
    generations,
)

from kvpool.memory.block_pool import BlockPool
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.pool_view import take_pool_view
from kvpool.memory.sequence_blocks import SequenceBlocks

BLOCK_SIZE = 4
NUM_BLOCKS = 16
SALTS = st.sampled_from([None, "tenant-a", "tenant-b"])
# A tiny alphabet makes shared prefixes (and prefix-cache hits) common.
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=14)


class HandOutLog(BlockPool):
    """A pool that notes each id it hands out for new content: the generation rule's oracle."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.handed_out: set[int] = set()

    def allocate(self, num_blocks: int) -> list[int]:
        block_ids = super().allocate(num_blocks)
        self.handed_out.update(block_ids)
        return block_ids


class BlockPoolMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.pool = HandOutLog(NUM_BLOCKS, KVLayout(BLOCK_SIZE))
        self.generations = generations(self.pool)
        self.tables: dict[int, SequenceBlocks] = {}
        self.expected_tokens: dict[int, list[int]] = {}
        self.drafts: dict[int, list[int]] = {}  # seq -> its tentative tokens, until commit
        self.next_id = 0

    def _register(self, table: SequenceBlocks, tokens: list[int]) -> int:
        seq_id = self.next_id
        self.next_id += 1
        self.tables[seq_id] = table
        self.expected_tokens[seq_id] = list(tokens)
        return seq_id

    def _stats_tuple(self):
        stats = self.pool.stats()
        return stats.num_free_blocks, stats.num_used_blocks, stats.num_cached_blocks

    @rule(target=sequences, tokens=TOKENS, salt=SALTS, reuse_from=st.integers(0, 50))
    def new_sequence(self, tokens, salt, reuse_from):
        """Start a sequence, sometimes as an existing sequence's prompt plus new tokens."""
        if self.tables and reuse_from % 2 == 0:
            donor = list(self.tables)[reuse_from % len(self.tables)]
            tokens = self.expected_tokens[donor] + tokens
        table = SequenceBlocks(self.pool, cache_salt=salt)
        before = self._stats_tuple()
        num_cached = table.take_cached_prefix(tokens)
        assert num_cached % BLOCK_SIZE == 0 and table.token_ids == tokens[:num_cached]
        try:
            table.append_tokens(tokens[num_cached:])
        except OutOfBlocksError:
            table.free()
            after = self._stats_tuple()
            assert after[1] == before[1], "a failed admission must give back what it took"
            return None
        return self._register(table, tokens)

    @rule(seq=sequences, tokens=TOKENS)
    def append(self, seq, tokens):
        """Append (copy-on-write happens whenever the last block is shared and partial)."""
        if seq not in self.tables or seq in self.drafts:
            return
        table = self.tables[seq]
        old_ids, old_tokens = list(table.block_ids), list(table.token_ids)
        try:
            copies = table.append_tokens(tokens)
        except OutOfBlocksError:
            assert table.block_ids == old_ids and table.token_ids == old_tokens
            return
        self.expected_tokens[seq].extend(tokens)
        for copy in copies:
            assert copy.src_block_id in old_ids and copy.dst_block_id not in old_ids

    @rule(target=sequences, seq=sequences)
    def fork(self, seq):
        if seq not in self.tables or seq in self.drafts:
            return None
        child = self.tables[seq].fork()
        return self._register(child, self.expected_tokens[seq])

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq in self.tables:
            self.tables.pop(seq).free()
            del self.expected_tokens[seq]
            self.drafts.pop(seq, None)

    @rule(seq=sequences, tokens=TOKENS)
    def draft(self, seq, tokens):
        """Tentative slots for drafted tokens; all or nothing, like any append."""
        if seq not in self.tables or seq in self.drafts:
            return
        table = self.tables[seq]
        old_ids = list(table.block_ids)
        try:
            copies = table.draft(len(tokens))
        except OutOfBlocksError:
            assert table.block_ids == old_ids and table.table.num_tentative == 0
            return
        assert all(copy.src_block_id in old_ids for copy in copies)
        self.drafts[seq] = tokens

    @precondition(lambda self: self.drafts)
    @rule(data=st.data())
    def commit(self, data):
        """Accept a prefix of the drafts; the blocks that held only rejected ones are freed at
        once, never having been published."""
        seq = data.draw(st.sampled_from(sorted(self.drafts)))
        drafted = self.drafts.pop(seq)
        num_accepted = data.draw(st.integers(0, len(drafted)))
        table = self.tables[seq]
        num_blocks = table.num_blocks
        dropped = table.commit_draft(drafted[:num_accepted])
        self.expected_tokens[seq].extend(drafted[:num_accepted])
        assert table.num_blocks + len(dropped) == num_blocks
        for block_id in dropped:
            assert self.pool.ref_count(block_id) == 0
            assert block_id in self.pool.free_block_ids(), "a rejected draft's block was cached"

    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def exhaust(self, data):
        """Grow one sequence until the pool runs dry; the failed append changes nothing."""
        seq = data.draw(st.sampled_from(sorted(self.tables)))
        table = self.tables[seq]
        while True:
            try:
                table.append_tokens([7] * BLOCK_SIZE)
            except OutOfBlocksError:
                break
            self.expected_tokens[seq].extend([7] * BLOCK_SIZE)
        assert self.pool.num_allocatable_blocks < table.num_blocks_to_append(BLOCK_SIZE)

    @rule()
    def free_everything(self):
        for table in self.tables.values():
            table.free()
        self.tables.clear()
        self.expected_tokens.clear()
        self.drafts.clear()
        stats = self.pool.stats()
        assert stats.num_used_blocks == 0
        assert stats.num_free_blocks + stats.num_cached_blocks == NUM_BLOCKS

    @invariant()
    def blocks_are_conserved(self):
        stats = self.pool.stats()
        assert stats.num_free_blocks + stats.num_used_blocks + stats.num_cached_blocks == NUM_BLOCKS
        self.pool.check_invariants()

    @invariant()
    def ref_counts_equal_owners(self):
        owners = Counter(b for table in self.tables.values() for b in table.block_ids)
        for block_id in range(1, NUM_BLOCKS + 1):  # 0 is the null block
            assert self.pool.ref_count(block_id) == owners[block_id]
        free_ids = set(self.pool.free_block_ids()) | set(self.pool.evictable_block_ids())
        assert not free_ids & set(owners), "a block is both free and owned"

    @invariant()
    def tables_hold_their_tokens_and_shape(self):
        for seq, table in self.tables.items():
            assert table.token_ids == self.expected_tokens[seq]
            num_drafted = len(self.drafts.get(seq, ()))
            assert table.table.num_tentative == num_drafted
            assert table.table.num_tokens == table.num_tokens + num_drafted
            assert table.num_blocks == -(-table.table.num_tokens // BLOCK_SIZE)

    @invariant()
    def tentative_slots_are_never_published(self):
        for table in self.tables.values():
            assert table.num_published_blocks * BLOCK_SIZE <= table.num_tokens

    @invariant()
    def hashed_blocks_hold_the_tokens_of_every_table_using_them(self):
        assert_cached_blocks_hold_table_tokens(self.pool, self.tables.values())

    @invariant()
    def the_pool_view_agrees_with_the_pool(self):
        tables = [tuple(table.block_ids) for table in self.tables.values()]
        assert_view_matches_pool(take_pool_view(self.pool, tables), self.pool, tables)

    @invariant()
    def generations_move_iff_handed_out_and_never_down(self):
        after = generations(self.pool)
        assert_generations_moved_exactly(self.generations, after, self.pool.handed_out)
        self.generations = after
        self.pool.handed_out.clear()

    @invariant()
    def different_salts_never_share_a_block(self):
        salts_by_block = defaultdict(set)
        for table in self.tables.values():
            for block_id in table.block_ids:
                salts_by_block[block_id].add(table.salt)
        assert all(len(salts) == 1 for salts in salts_by_block.values())


BlockPoolMachine.TestCase.settings = settings(
    max_examples=500, stateful_step_count=25, deadline=None
)
TestBlockPoolMachine = BlockPoolMachine.TestCase

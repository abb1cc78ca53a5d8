"""Property test: random interleavings of sequence operations on a hybrid pool (a full group
and a sliding-window group of twice its page size, in one arena too small for everything)
keep every group's and the arena's invariants, and never let a sequence read KV that is not
its own.

A shadow KV cache (per group, per block: the token each slot was last written with) runs
beside the pool: appends write their tokens into the slots their tables name, copies-on-write
copy a block's slots, prefix hits write nothing. After every step, every block a sequence
still reads (all of the full group's; a sliding group's from the first block its next query
reads) must hold that sequence's own tokens, slot by slot.
"""

from __future__ import annotations

from collections import Counter

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.sequence_blocks import SequenceBlocks
from tests.memory.hybrid_checks import BLOCK_SIZE, gemma_like_groups, hybrid_pool

SALTS = st.sampled_from([None, "tenant-a"])
TOKENS = st.lists(st.integers(min_value=0, max_value=2), min_size=1, max_size=14)


class HybridPoolMachine(RuleBasedStateMachine):
    sequences = Bundle("sequences")

    @initialize(window=st.sampled_from([1, 5, 8, 13]), caching=st.booleans())
    def make_pool(self, window, caching):
        self.pool = hybrid_pool(gemma_like_groups(window=window), num_pages_of_largest=14,
                                enable_prefix_caching=caching)
        self.seqs: dict[int, SequenceBlocks] = {}
        self.drafts: dict[int, list[int]] = {}
        self.kv = [{} for _ in self.pool.groups]  # group -> block id -> slot tokens
        self.next_id = 0

    # ------------------------------------------------------------- the shadow KV
    def _write(self, seq: SequenceBlocks, start: int, tokens: list[int], copies) -> None:
        for copy in copies:
            self.kv[copy.group][copy.dst_block_id] = list(self.kv[copy.group][copy.src_block_id])
        for group, table in enumerate(seq.table.tables):
            for offset, token in enumerate(tokens):
                position = start + offset
                block_id = table.block_ids[position // BLOCK_SIZE]
                assert block_id != NULL_BLOCK_ID, "a new token's block was dropped"
                slots = self.kv[group].setdefault(block_id, [None] * BLOCK_SIZE)
                slots[position % BLOCK_SIZE] = token

    def _append(self, seq: SequenceBlocks, tokens: list[int]) -> None:
        start = seq.table.num_tokens
        copies = seq.append_tokens(tokens)
        self._write(seq, start, tokens, copies)

    # ------------------------------------------------------------------- rules
    @rule(target=sequences, tokens=TOKENS, salt=SALTS, reuse_from=st.integers(0, 50))
    def new_sequence(self, tokens, salt, reuse_from):
        """Start a sequence from its longest cached prefix, sometimes another's tokens."""
        if self.seqs and reuse_from % 2 == 0:
            donor = self.seqs[sorted(self.seqs)[reuse_from % len(self.seqs)]]
            tokens = donor.token_ids + tokens
        seq = SequenceBlocks(self.pool, cache_salt=salt)
        num_cached = seq.take_cached_prefix(tokens)
        assert seq.token_ids == tokens[:num_cached] and num_cached % BLOCK_SIZE == 0
        if num_cached:
            event("prefix hit")
        try:
            self._append(seq, tokens[num_cached:])
        except OutOfBlocksError:
            event("admission refused")
            seq.free()
            return None
        self.next_id += 1
        self.seqs[self.next_id] = seq
        return self.next_id

    @rule(seq=sequences, tokens=TOKENS)
    def append(self, seq, tokens):
        if seq not in self.seqs or seq in self.drafts:
            return
        blocks = self.seqs[seq]
        before = [list(table.block_ids) for table in blocks.table.tables]
        try:
            self._append(blocks, tokens)
        except OutOfBlocksError:
            after = [list(table.block_ids) for table in blocks.table.tables]
            # All or nothing, but for the dead blocks dropped before growing.
            for old, new in zip(before, after, strict=True):
                assert len(old) == len(new)
                assert all(n in (o, NULL_BLOCK_ID) for o, n in zip(old, new, strict=True))

    @rule(target=sequences, seq=sequences)
    def fork(self, seq):
        if seq not in self.seqs or seq in self.drafts:
            return None
        self.next_id += 1
        self.seqs[self.next_id] = self.seqs[seq].fork()
        return self.next_id

    @rule(seq=consumes(sequences))
    def free(self, seq):
        if seq in self.seqs:
            self.seqs.pop(seq).free()
            self.drafts.pop(seq, None)

    @rule(seq=sequences, tokens=TOKENS)
    def draft(self, seq, tokens):
        if seq not in self.seqs or seq in self.drafts:
            return
        blocks = self.seqs[seq]
        start = blocks.table.num_tokens
        try:
            copies = blocks.draft(len(tokens))
        except OutOfBlocksError:
            return
        self._write(blocks, start, tokens, copies)
        self.drafts[seq] = tokens

    @precondition(lambda self: self.drafts)
    @rule(data=st.data())
    def commit(self, data):
        seq = data.draw(st.sampled_from(sorted(self.drafts)))
        drafted = self.drafts.pop(seq)
        self.seqs[seq].commit_draft(drafted[: data.draw(st.integers(0, len(drafted)))])
        event("drafts committed")

    # -------------------------------------------------------------- invariants
    @invariant()
    def pool_and_arena_hold(self):
        self.pool.check_invariants()
        for seq in self.seqs.values():
            seq.table.check()

    @invariant()
    def ref_counts_equal_holders(self):
        for group, group_pool in enumerate(self.pool.pools):
            holders = Counter(block_id for seq in self.seqs.values()
                              for block_id in seq.table.tables[group].live_block_ids)
            assert NULL_BLOCK_ID not in holders
            for block_id in group_pool.online_block_ids():
                assert group_pool.ref_count(block_id) == holders[block_id]

    @invariant()
    def every_block_a_sequence_reads_holds_its_own_tokens(self):
        for seq_id, seq in self.seqs.items():
            tokens = seq.token_ids + self.drafts.get(seq_id, [])
            for group, table in enumerate(seq.table.tables):
                first = self.pool.groups[group].first_live_block(seq.num_tokens)
                assert table.num_dropped_blocks <= first, "a block still read was dropped"
                for index in range(first, table.num_blocks):
                    slots = self.kv[group][table.block_ids[index]]
                    for position in range(index * BLOCK_SIZE,
                                          min((index + 1) * BLOCK_SIZE, len(tokens))):
                        assert slots[position % BLOCK_SIZE] == tokens[position], (
                            f"group {group} block {index} slot {position}")


HybridPoolMachine.TestCase.settings = settings(max_examples=400, stateful_step_count=30,
                                               deadline=None)
TestHybridPoolMachine = HybridPoolMachine.TestCase

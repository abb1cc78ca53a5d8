"""Property test: random interleavings of admit, grow, swap out, swap in, spill (a flood of
allocations), reload, abort and fork keep the invariants of the device pool and the host tier,
and every running sequence's KV is exactly what its own tokens would have computed.

The "model" is a stand-in: the KV written for position p of a sequence is a value derived from
its salt and tokens 0..p (as a real model's KV depends on the whole prefix), so a block served
from the wrong prefix, the wrong tenant, a stale host copy or a half-done copy reads wrong.
A tiny device pool makes evictions (spills to the host) and swap-outs frequent; a tiny alphabet
makes shared prefixes (device and host prefix hits) frequent.
"""

from __future__ import annotations

import zlib
from collections import Counter

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.preemption import SWAP, PreemptionPolicy
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.sequence import Request, Sequence
from kvpool.memory.errors import OutOfBlocksError
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.prefix_cache import hash_full_blocks, salt_key

LAYOUT = KVLayout(block_size=2, num_layers=1, num_kv_heads=1, head_dim=2)
NUM_DEVICE_BLOCKS = 6
NUM_HOST_BLOCKS = 5
SALTS = st.sampled_from([None, "tenant-a"])
TOKENS = st.lists(st.integers(min_value=0, max_value=1), min_size=1, max_size=7)
PICK = st.integers(min_value=0, max_value=10**6)


def kv_value(salt: str | None, prefix: list[int]) -> float:
    """What the stand-in model writes for the last token of `prefix`."""
    return float(zlib.crc32(repr((salt, prefix)).encode()) % 10007)


class KVTiersMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        host_bytes = (NUM_HOST_BLOCKS + 1) * LAYOUT.bytes_per_block
        self.memory = KVMemory(LAYOUT, NUM_DEVICE_BLOCKS, host_num_bytes=host_bytes)
        assert self.memory.tiers.host.pool.num_blocks == NUM_HOST_BLOCKS
        policy = PreemptionPolicy(SWAP, LAYOUT.bytes_per_block, lambda num_tokens: 0.0)
        self.kv = KVCacheManager(self.memory, policy)
        self.running: list[Sequence] = []
        self.waiting: list[Sequence] = []
        self.history: list[list[int]] = []  # every prompt so far: reused to make prefix hits
        self.next_id = 0

    # ---------------------------------------------------------------- helpers
    def _new_sequence(self, tokens: list[int], salt: str | None) -> Sequence:
        request = Request(str(self.next_id), None, tokens, SamplingParams(), 0.0,
                          salt_key(salt), (None,), cache_salt=salt)
        hashes = hash_full_blocks(tokens, LAYOUT.block_size, request.salt)
        seq = Sequence(self.next_id, request, 0, self.kv.new_block_table(), hashes)
        request.sequences.append(seq)
        self.next_id += 1
        return seq

    def _compute(self, seq: Sequence, copies) -> None:
        """One step for `seq`: the queued copies, copy-on-write, then its new tokens' KV."""
        self.memory.tiers.before_step()
        self.memory.kv_cache.copy_blocks(copies)
        tokens = seq.token_ids()
        table = seq.block_table
        kv = self.memory.kv_cache.tensor
        for position in range(seq.num_computed_tokens, table.num_tokens):
            slot = LAYOUT.slot(table.block_ids, position)
            block_id, offset = divmod(slot, LAYOUT.block_size)
            kv[block_id, :, :, offset] = kv_value(seq.request.cache_salt, tokens[: position + 1])
        seq.num_computed_tokens = table.num_tokens
        self.kv.mark_computed(seq)
        self.memory.tiers.after_step()

    def _admit(self, seq: Sequence) -> bool:
        plan = self.kv.plan_admission(seq, 10**6, allow_partial=False, keep_watermark=False)
        if plan is None:
            return False
        was_swapped = self.kv.is_swapped(seq)
        num_computed = seq.num_computed_tokens
        copies = self.kv.admit(seq, plan)
        if was_swapped:  # resumes exactly where it stopped
            assert seq.num_computed_tokens == num_computed
        if seq.request.num_cached_tokens is None:
            seq.request.num_cached_tokens = plan.num_cached_tokens
        self._compute(seq, copies)
        self.running.append(seq)
        return True

    # ------------------------------------------------------------------ rules
    @rule(tokens=TOKENS, salt=SALTS, reuse=PICK)
    def admit(self, tokens, salt, reuse):
        """A new sequence, often an earlier prompt plus more tokens (a prefix hit somewhere)."""
        if self.history and reuse % 3:
            tokens = self.history[reuse % len(self.history)] + tokens[: reuse % 3]
        self.history.append(list(tokens))
        self._admit(self._new_sequence(list(tokens), salt))

    @rule(pick=PICK, token=st.integers(0, 1))
    def grow(self, pick, token):
        """Decode one token: sampled, given a slot (if one is free), computed."""
        if not self.running:
            return
        seq = self.running[pick % len(self.running)]
        if seq.num_uncomputed_tokens == 0:
            self.kv.append_output(seq, token)
        try:
            copies = self.kv.append_slots(seq, seq.num_uncomputed_tokens)
        except OutOfBlocksError:
            return
        self._compute(seq, copies)

    @rule(pick=PICK)
    def preempt(self, pick):
        """Swap out (or, when the host is full, drop) a running sequence."""
        if not self.running:
            return
        seq = self.running.pop(pick % len(self.running))
        num_computed = seq.num_computed_tokens
        kind = self.kv.preempt(seq)
        assert seq.block_table.num_blocks == 0
        assert seq.num_computed_tokens == (num_computed if kind == SWAP else 0)
        assert self.kv.is_swapped(seq) == (kind == SWAP)
        self.waiting.append(seq)

    @rule(pick=PICK)
    def resume(self, pick):
        """Re-admit a waiting sequence: swap in, or recompute from the prefix caches."""
        if not self.waiting:
            return
        seq = self.waiting[pick % len(self.waiting)]
        if self._admit(seq):
            self.waiting.remove(seq)

    @rule()
    def flood(self):
        """A burst elsewhere takes every allocatable block for a step: every cached block is
        evicted (spilled to the host), so what comes back next must come from the host."""
        pool = self.memory.pool
        if pool.num_allocatable_blocks:
            block_ids = pool.allocate(pool.num_allocatable_blocks)
            self.memory.tiers.before_step()
            pool.free(block_ids)

    @rule(pick=PICK)
    def abort(self, pick):
        everyone = self.running + self.waiting
        if not everyone:
            return
        seq = everyone[pick % len(everyone)]
        self.kv.free(seq)
        (self.running if seq in self.running else self.waiting).remove(seq)

    @rule(pick=PICK)
    def fork(self, pick):
        if not self.running:
            return
        parent = self.running[pick % len(self.running)]
        if parent.num_uncomputed_tokens:
            return
        child = Sequence(self.next_id, parent.request, len(parent.request.sequences),
                         self.kv.fork(parent), list(parent.block_hashes),
                         list(parent.output_token_ids), parent.num_computed_tokens)
        self.next_id += 1
        parent.request.sequences.append(child)
        self.running.append(child)

    # ------------------------------------------------------------- invariants
    @invariant()
    def pools_hold_their_invariants(self):
        self.memory.check_invariants(self.kv.swapped)
        holders = Counter(b for seq in self.running for b in seq.block_table.block_ids)
        for block_id in self.memory.pool.online_block_ids():
            assert self.memory.pool.ref_count(block_id) == holders[block_id]

    @invariant()
    def running_kv_is_their_own(self):
        self.memory.tiers.before_step()  # copies queued by the last rule land first
        kv = self.memory.kv_cache.tensor
        for seq in self.running:
            tokens = seq.token_ids()
            for position in range(seq.num_computed_tokens):
                slot = LAYOUT.slot(seq.block_table.block_ids, position)
                block_id, offset = divmod(slot, LAYOUT.block_size)
                expected = kv_value(seq.request.cache_salt, tokens[: position + 1])
                assert (kv[block_id, :, :, offset] == expected).all(), (seq.seq_id, position)

    def teardown(self):
        for seq in self.running + self.waiting:
            self.kv.free(seq)
        self.memory.tiers.before_step()
        assert self.memory.pool.num_used_blocks == 0, "device blocks leaked"
        assert self.memory.tiers.host.pool.num_used_blocks == 0, "host blocks leaked"
        self.memory.check_invariants()


KVTiersMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=30, deadline=None
)
TestKVTiersMachine = KVTiersMachine.TestCase

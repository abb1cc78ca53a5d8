"""Block leases: references held while a remote reader may pull, and the gate before each send.

Small scenarios on tiny pools assert exact ids, reference counts and one test per refusal;
a property test runs sequences, leases, a clock and a fake transport that reads the KV tag the
"model runner" wrote into each block, and checks that no send ever delivers bytes other than
those promised.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from kvpool.memory.block_leases import (
    BlockLeases,
    LeasedBlock,
    LeaseRefused,
    Refusal,
    ReleaseOutcome,
)
from kvpool.memory.block_pool import NULL_BLOCK_ID, BlockPool
from kvpool.memory.errors import InvalidBlockError
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import hash_full_blocks
from kvpool.memory.resizable_block_pool import ResizableBlockPool
from kvpool.memory.sequence_blocks import SequenceBlocks

TTL = 4.0


def make_leases(num_blocks: int = 4, block_size: int = 2) -> BlockLeases:
    return BlockLeases(BlockPool(num_blocks, KVLayout(block_size)), TTL)


def refusal(leases: BlockLeases, lease_id: str, pairs, now: float) -> Refusal:
    with pytest.raises(LeaseRefused) as refused:
        leases.check(lease_id, pairs, now)
    assert refused.value.lease_id == lease_id
    return refused.value.reason


# ------------------------------------------------------------------ scenarios
def test_a_lease_holds_a_reference_on_each_block_and_records_its_generation():
    leases = make_leases()
    pool = leases.pool
    block_ids = pool.allocate(2)
    lease = leases.lease("req-1", block_ids, now=10.0)
    assert lease.pairs == [LeasedBlock(1, 1), LeasedBlock(2, 1)] and lease.expires_at == 14.0
    assert [pool.ref_count(b) for b in block_ids] == [2, 2]
    pool.free(block_ids)  # the prefill side is done with them; the lease still holds them
    assert pool.num_used_blocks == 2 and leases.check("req-1", lease.pairs, 13.9) is lease
    assert leases.release("req-1") is ReleaseOutcome.RELEASED
    assert pool.free_block_ids()[:2] == [1, 2] and pool.num_used_blocks == 0
    leases.check_invariants()
    pool.check_invariants()


def test_a_released_block_goes_back_cached_when_hashed_and_a_cached_one_can_be_leased():
    leases = make_leases(block_size=2)
    pool = leases.pool
    (block_id,) = pool.allocate(1)
    (block_hash,) = hash_full_blocks([1, 2], 2)
    assert pool.publish(block_id, block_hash, [1, 2])
    leases.lease("a", [block_id], now=0.0)
    pool.free([block_id])
    leases.release("a")
    assert pool.evictable_block_ids() == [block_id]
    lease = leases.lease("b", [block_id], now=0.0)  # revived: same content, same generation
    assert lease.pairs == [(block_id, 1)] and pool.ref_count(block_id) == 1
    leases.check("b", lease.pairs, 1.0)
    leases.check_invariants()


def test_two_leases_on_one_block_each_hold_their_own_reference():
    leases = make_leases()
    pool = leases.pool
    (block_id,) = pool.allocate(1)
    first = leases.lease("reader-1", [block_id], now=0.0)
    second = leases.lease("reader-2", [block_id], now=1.0)
    pool.free([block_id])
    assert pool.ref_count(block_id) == 2 and leases.stats().num_leased_blocks == 2
    leases.release("reader-1")
    assert pool.ref_count(block_id) == 1 and leases.check("reader-2", second.pairs, 2.0)
    assert refusal(leases, "reader-1", first.pairs, 2.0) is Refusal.RELEASED
    assert leases.expire(5.0) == ["reader-2"] and pool.ref_count(block_id) == 0
    leases.check_invariants()


def test_lease_is_all_or_nothing():
    leases = make_leases()
    pool = leases.pool
    used = pool.allocate(2)
    for bad, error in (([used[0], 4], InvalidBlockError), ([NULL_BLOCK_ID], InvalidBlockError),
                       ([used[0], used[0]], ValueError)):
        with pytest.raises(error):
            leases.lease("x", bad, now=0.0)
    assert [pool.ref_count(b) for b in used] == [1, 1] and leases.stats().num_leases == 0
    leases.lease("x", used, now=0.0)
    with pytest.raises(ValueError, match="already live"):
        leases.lease("x", used, now=0.0)
    assert [pool.ref_count(b) for b in used] == [2, 2]
    with pytest.raises(ValueError, match="ttl_seconds"):
        BlockLeases(pool, 0.0)


def test_refusal_unknown_lease():
    assert refusal(make_leases(), "never-granted", [], 0.0) is Refusal.UNKNOWN_LEASE


def test_refusal_released_lease():
    leases = make_leases()
    lease = leases.lease("r", leases.pool.allocate(1), now=0.0)
    leases.release("r")
    assert refusal(leases, "r", lease.pairs, 1.0) is Refusal.RELEASED


def test_refusal_expired_lease_before_and_after_the_sweep():
    leases = make_leases()
    lease = leases.lease("r", leases.pool.allocate(1), now=0.0)
    leases.check("r", lease.pairs, TTL - 0.5)
    assert refusal(leases, "r", lease.pairs, TTL) is Refusal.EXPIRED  # due, not yet swept
    assert leases.expire(TTL) == ["r"]
    assert refusal(leases, "r", lease.pairs, TTL) is Refusal.EXPIRED


def test_refusal_pair_not_in_lease():
    leases = make_leases()
    leased, other = leases.pool.allocate(2)
    leases.lease("r", [leased], now=0.0)
    assert refusal(leases, "r", [(other, 1)], 0.0) is Refusal.NOT_IN_LEASE
    assert refusal(leases, "r", [(leased, 2)], 0.0) is Refusal.NOT_IN_LEASE  # wrong generation


def test_refusal_stale_generation_when_a_leased_block_was_relocated():
    pool = ResizableBlockPool(4, KVLayout(2))
    pool.add_blocks([1, 2, 3])
    leases = BlockLeases(pool, TTL)
    lease = leases.lease("r", pool.allocate(1), now=0.0)
    pool.relocate_blocks([1])  # what an elastic shrink refuses to do to a leased block
    assert refusal(leases, "r", lease.pairs, 0.0) is Refusal.STALE_GENERATION


def test_the_classic_bug_a_send_after_free_and_reuse_is_refused():
    leases = make_leases(num_blocks=1)
    pool = leases.pool
    (block_id,) = pool.allocate(1)
    stale = leases.lease("prefill-1", [block_id], now=0.0).pairs
    pool.free([block_id])  # the prefill request finished
    leases.release("prefill-1")  # the decode side said done (or the request was aborted)
    assert pool.allocate(1) == [block_id]  # reused at once for another request's KV
    assert refusal(leases, "prefill-1", stale, 1.0) is Refusal.RELEASED
    leases.lease("prefill-2", [block_id], now=1.0)
    assert refusal(leases, "prefill-2", stale, 1.0) is Refusal.NOT_IN_LEASE


def test_refusals_and_passes_are_counted_once_per_check():
    leases = make_leases()
    lease = leases.lease("r", leases.pool.allocate(2), now=0.0)
    leases.check("r", lease.pairs, 0.0)
    refusal(leases, "r", [(3, 1), (4, 1)], 0.0)
    refusal(leases, "nope", [], 0.0)
    stats = leases.stats()
    assert stats.num_checks_passed == 1
    assert stats.num_refusals == {Refusal.UNKNOWN_LEASE: 1, Refusal.RELEASED: 0,
                                  Refusal.EXPIRED: 0, Refusal.NOT_IN_LEASE: 1,
                                  Refusal.STALE_GENERATION: 0}


def test_release_is_idempotent_and_reports_an_earlier_end():
    leases = make_leases()
    pool = leases.pool
    leases.lease("done", pool.allocate(1), now=0.0)
    leases.lease("late", pool.allocate(1), now=0.0)
    assert leases.release("done") is ReleaseOutcome.RELEASED
    assert leases.release("done") is ReleaseOutcome.ALREADY_RELEASED
    assert leases.expire(TTL) == ["late"]
    used_before = pool.num_used_blocks
    assert leases.release("late") is ReleaseOutcome.ALREADY_EXPIRED
    assert leases.release("ghost") is ReleaseOutcome.UNKNOWN_LEASE
    assert pool.num_used_blocks == used_before == 2  # the tables still hold theirs
    stats = leases.stats()
    assert (stats.num_granted, stats.num_released, stats.num_expired) == (2, 1, 1)


def test_expire_ends_due_leases_soonest_first_and_only_those():
    leases = make_leases()
    pool = leases.pool
    leases.lease("b", pool.allocate(1), now=2.0)
    leases.lease("a", pool.allocate(1), now=1.0)
    leases.lease("c", pool.allocate(1), now=3.0)
    assert leases.expire(4.9) == []
    assert leases.expire(6.0) == ["a", "b"]
    assert [lease.lease_id for lease in leases.live_leases()] == ["c"]
    leases.check_invariants()


def test_an_id_granted_again_is_not_ended_by_its_first_grant_deadline():
    leases = make_leases()
    block_id = leases.pool.allocate(1)[0]
    leases.lease("r", [block_id], now=0.0)
    leases.release("r")
    lease = leases.lease("r", [block_id], now=3.0)
    assert leases.expire(TTL) == [] and leases.check("r", lease.pairs, TTL)
    assert leases.expire(3.0 + TTL) == ["r"]


# ------------------------------------------------------------------ property test
BLOCK_SIZE = 2
NUM_BLOCKS = 6
TOKENS = st.lists(st.integers(min_value=0, max_value=1), min_size=1, max_size=6)
STEPS = st.sampled_from([0.0, 1.0, TTL / 2, TTL])
PAIR_CHOICES = st.sampled_from(["all", "some", "wrong_generation", "foreign_block"])


class FakeKVPool(BlockPool):
    """A pool whose KV is a tag per block: the fake model runner writes a new tag into every
    block handed out for new content, and a revived block keeps its tag (its KV)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kv: dict[int, int] = {}
        self._tags = itertools.count()

    def allocate(self, num_blocks: int) -> list[int]:
        block_ids = super().allocate(num_blocks)
        for block_id in block_ids:
            self.kv[block_id] = next(self._tags)
        return block_ids


def fake_send(leases: BlockLeases, lease_id: str, pairs, now: float) -> list[int] | Refusal:
    """The transport: gate, then read the KV of each pair's block (what goes on the wire)."""
    try:
        leases.check(lease_id, pairs, now)
    except LeaseRefused as refused:
        return refused.reason
    return [leases.pool.kv[block_id] for block_id, _ in pairs]


@dataclass
class Promise:
    """What the model says a lease promised: pairs, the KV each block held, the deadline."""

    generations: dict[int, int]
    kv: dict[int, int]
    expires_at: float
    ended: Refusal | None = None  # RELEASED or EXPIRED once it ends


class LeaseMachine(RuleBasedStateMachine):
    """Sequences come and go, some of their blocks are leased, the clock moves, leases end by
    release or expiry, blocks are evicted and reused, and sends arrive at any point."""

    sequences = Bundle("sequences")

    def __init__(self) -> None:
        super().__init__()
        self.pool = FakeKVPool(NUM_BLOCKS, KVLayout(BLOCK_SIZE))
        self.leases = BlockLeases(self.pool, TTL)
        self.now = 0.0
        self.tables: dict[int, SequenceBlocks] = {}
        self.promises: dict[str, Promise] = {}  # every grant, ended ones included
        self.num_sequences = 0

    # --------------------------------------------------- sequences and memory
    @rule(target=sequences, tokens=TOKENS)
    def new_sequence(self, tokens):
        table = SequenceBlocks(self.pool)
        table.take_cached_prefix(tokens)
        if table.num_blocks_to_append(len(tokens) - table.num_tokens) > (
                self.pool.num_allocatable_blocks):
            table.free()
            return None
        table.append_tokens(tokens[table.num_tokens :])
        self.num_sequences += 1
        self.tables[self.num_sequences] = table
        return self.num_sequences

    @rule(seq=sequences)
    def free_sequence(self, seq):
        if seq in self.tables:
            self.tables.pop(seq).free()

    @rule()
    def reuse_every_allocatable_block(self):
        """Another request takes all it can (fresh blocks, then evicted cached ones), so
        every block no one holds gets new KV, then it finishes."""
        block_ids = self.pool.allocate(self.pool.num_allocatable_blocks)
        self.pool.free(block_ids)

    # ---------------------------------------------------------------- leases
    @precondition(lambda self: self.tables)
    @rule(data=st.data())
    def lease_used_blocks(self, data):
        table = self.tables[data.draw(st.sampled_from(sorted(self.tables)))]
        block_ids = data.draw(st.lists(st.sampled_from(table.block_ids), min_size=1,
                                       unique=True))
        self._grant(block_ids)

    @precondition(lambda self: self.pool.num_cached_blocks)
    @rule(data=st.data())
    def lease_cached_blocks(self, data):
        """A second reader of a cached prefix no table holds: the lease revives it."""
        self._grant(data.draw(st.lists(st.sampled_from(self.pool.evictable_block_ids()),
                                       min_size=1, unique=True)))

    def _grant(self, block_ids: list[int]) -> None:
        lease_id = f"lease-{len(self.promises)}"
        kv = {block_id: self.pool.kv[block_id] for block_id in block_ids}
        lease = self.leases.lease(lease_id, block_ids, self.now)
        assert lease.block_ids == block_ids and lease.expires_at == self.now + TTL
        self.promises[lease_id] = Promise(dict(lease.generations), kv, lease.expires_at)

    @rule(step=STEPS)
    def advance_clock(self, step):
        self.now += step

    @rule()
    def expire(self):
        due = sorted((p.expires_at, int(lid.split("-")[1]), lid)
                     for lid, p in self.promises.items()
                     if p.ended is None and p.expires_at <= self.now)
        assert self.leases.expire(self.now) == [lease_id for *_, lease_id in due]
        for *_, lease_id in due:
            self.promises[lease_id].ended = Refusal.EXPIRED

    @precondition(lambda self: self.promises)
    @rule(data=st.data())
    def release(self, data):
        lease_id = data.draw(st.sampled_from([*self.promises, "never-granted"]))
        promise = self.promises.get(lease_id)
        expected = (ReleaseOutcome.UNKNOWN_LEASE if promise is None else
                    ReleaseOutcome.RELEASED if promise.ended is None else
                    ReleaseOutcome.ALREADY_RELEASED if promise.ended is Refusal.RELEASED else
                    ReleaseOutcome.ALREADY_EXPIRED)
        assert self.leases.release(lease_id) is expected
        if expected is ReleaseOutcome.RELEASED:
            promise.ended = Refusal.RELEASED

    # ------------------------------------------------------------------ sends
    @precondition(lambda self: self.promises)
    @rule(data=st.data(), choice=PAIR_CHOICES)
    def send(self, data, choice):
        lease_id = data.draw(st.sampled_from([*self.promises, "never-granted"]))
        promise = self.promises.get(lease_id)
        pairs = self._pairs(data, choice, promise)
        result = fake_send(self.leases, lease_id, pairs, self.now)
        assert result == self._expected_send(promise, pairs)
        event(f"send: {result.value if isinstance(result, Refusal) else 'sent'}")
        if promise and any(self.pool.generation(b) != g for b, g in promise.generations.items()):
            event("send: after its blocks were reused")
        if not isinstance(result, Refusal):  # what went out is what was promised, still held
            assert result == [promise.kv[block_id] for block_id, _ in pairs]
            assert all(self.pool.ref_count(block_id) >= 1 for block_id, _ in pairs)

    def _pairs(self, data, choice, promise: Promise | None) -> list[tuple[int, int]]:
        leased = sorted(promise.generations.items()) if promise else [(1, 1)]
        if choice == "all":
            return leased
        pairs = data.draw(st.lists(st.sampled_from(leased), min_size=1, unique=True))
        if choice == "wrong_generation":
            block_id, generation = pairs[0]
            pairs[0] = (block_id, generation + data.draw(st.sampled_from([-1, 1])))
        elif choice == "foreign_block":
            block_id = data.draw(st.integers(1, NUM_BLOCKS))
            pairs.append((block_id, self.pool.generation(block_id)))
        return pairs

    def _expected_send(self, promise: Promise | None, pairs) -> list[int] | Refusal:
        """The model's verdict: the lease's state first, then pair by pair; a live lease's
        blocks keep their generation (its references pin them), so no stale pair passes
        membership."""
        if promise is None:
            return Refusal.UNKNOWN_LEASE
        if promise.ended is not None:
            return promise.ended
        if self.now >= promise.expires_at:
            return Refusal.EXPIRED
        if any(promise.generations.get(b) != g for b, g in pairs):
            return Refusal.NOT_IN_LEASE
        return [promise.kv[block_id] for block_id, _ in pairs]

    # --------------------------------------------------------------- the end
    @rule(by_expiry=st.booleans())
    def end_everything(self, by_expiry):
        """Every lease ends (released, or the clock runs past every deadline) and every
        sequence finishes: the pool is idle again."""
        if by_expiry:
            self.now += TTL
            self.expire()
        for lease_id, promise in self.promises.items():
            if promise.ended is None:
                assert self.leases.release(lease_id) is ReleaseOutcome.RELEASED
                promise.ended = Refusal.RELEASED
        for table in self.tables.values():
            table.free()
        self.tables.clear()
        stats = self.pool.stats()
        assert stats.num_used_blocks == 0
        assert stats.num_free_blocks + stats.num_cached_blocks == NUM_BLOCKS
        assert (self.leases.stats().num_leases, self.leases.stats().num_leased_blocks) == (0, 0)

    # ------------------------------------------------------------ invariants
    @invariant()
    def pool_and_lease_invariants_hold(self):
        self.pool.check_invariants()
        self.leases.check_invariants()

    @invariant()
    def ref_counts_are_tables_plus_live_leases(self):
        holders = Counter(b for table in self.tables.values() for b in table.block_ids)
        live = [p for p in self.promises.values() if p.ended is None]
        holders.update(b for promise in live for b in promise.generations)
        for block_id in range(1, NUM_BLOCKS + 1):
            assert self.pool.ref_count(block_id) == holders[block_id]
        stats = self.leases.stats()
        assert stats.num_leases == len(live)
        assert stats.num_leased_blocks == sum(len(p.generations) for p in live)

    @invariant()
    def live_leases_pin_their_kv(self):
        for promise in self.promises.values():
            if promise.ended is None:
                for block_id, generation in promise.generations.items():
                    assert self.pool.generation(block_id) == generation
                    assert self.pool.kv[block_id] == promise.kv[block_id]


LeaseMachine.TestCase.settings = settings(max_examples=300, stateful_step_count=30,
                                          deadline=None)
TestLeaseMachine = LeaseMachine.TestCase

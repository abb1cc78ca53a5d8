"""Property test: random interleavings of store, flush, find, load, damage, eviction behind the
tier's back, Redis killed and restarted keep the shared tier equal to a plain model of it, on a
real redis-server (FLUSHDB per example).

The model: what Redis holds (each key good or damaged), the writes and deletes queued (they
reach Redis, in order, at `flush`: writes wait on a gate until then), what the tier's memo knows
(present or absent), whether Redis is up, and every counter. Invariants checked after each step:
- `find` answers from the memo where it knows, else from Redis, and never reports absent a
  block this tier wrote that Redis still holds (no false negatives, while up);
- `load_run` serves only blocks bit-identical to what was stored, and ends before the first
  block that is missing or damaged; a damaged one is counted and deleted, never served;
- each `find` makes at most one round trip, each `load_run` exactly one (none while down);
- while Redis is down nothing is found or loaded and every new store is dropped and counted;
  once it is back (reconnected, counted), the memo is empty and writes land again;
- at quiescence Redis holds exactly the model's keys, and the tier's own invariants hold.
"""

from __future__ import annotations

from disk_checks import Gate, make_block, same_bits
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from redis_checks import DAMAGE, damaged_value, key_of, make_tier, wait_until

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.tiers.redis_tier import KEY_PREFIX

SM_LAYOUT = KVLayout(block_size=4, num_layers=1, num_kv_heads=2, head_dim=4, dtype="int8")
SM_KEYS = st.integers(0, 5)
SM_BLOCKS = {key: make_block(SM_LAYOUT, key) for key in range(6)}
SM_MAX_PENDING = 2  # blocks
COUNTERS = ("num_stored_blocks", "num_loaded_blocks", "num_rejected_blocks", "num_errors",
            "num_dropped_writes", "num_reconnects", "num_lookups", "num_fetches")


class RedisTierMachine(RuleBasedStateMachine):
    server = None  # the test's RedisServer, set before the machine runs

    def __init__(self) -> None:
        super().__init__()
        self.client = self.server.client()
        self.client.flushdb()
        self.redis: dict[int, bool] = {}  # key → good (False: damaged)
        self.queued: list[tuple[str, int]] = []  # ("set" | "del", key), in the writer's order
        self.known: set[int] = set()
        self.missing: set[int] = set()
        self.is_up = True
        self.expected = dict.fromkeys(COUNTERS, 0)
        self.gate = Gate()
        self.tier = make_tier(self.server.url, SM_LAYOUT, miss_ttl=3600,
                              max_pending_bytes=SM_MAX_PENDING * SM_LAYOUT.bytes_per_block)

    # ------------------------------------------------------------ the tier's API
    @rule(key=SM_KEYS)
    def store(self, key):
        pending = {k for op, k in self.queued if op == "set"}
        if key not in self.known:
            self.missing.discard(key)  # this tier's own write ends a remembered miss
            if key in pending:
                pass
            elif not self.is_up or len(pending) >= SM_MAX_PENDING:
                self.expected["num_dropped_writes"] += 1
            else:
                self.queued.append(("set", key))
        self.tier.store(*SM_BLOCKS[key], ready=self.gate)

    @rule()
    def flush(self):
        self.gate.open()
        assert self.tier.flush(timeout=10)
        for op, key in self.queued:
            if op == "del":
                self.redis.pop(key, None)
            else:
                self.redis[key] = True
                self.known.add(key)
                self.missing.discard(key)
                self.expected["num_stored_blocks"] += 1
        self.queued.clear()
        self.gate = Gate()

    @rule(keys=st.lists(SM_KEYS, min_size=1, max_size=4))
    def find(self, keys):
        answers = self.tier.find([SM_BLOCKS[key][0] for key in keys])
        if not self.is_up:
            assert answers == [False] * len(keys)
            return
        expected, asked = [], False
        for key in keys:
            if key in self.known or key in self.missing:
                expected.append(key in self.known)
                continue
            asked = True
            present = key in self.redis
            expected.append(present)
            (self.known if present else self.missing).add(key)
            (self.missing if present else self.known).discard(key)
        assert answers == expected, (keys, answers, expected)
        self.expected["num_lookups"] += asked

    @rule(keys=st.lists(SM_KEYS, min_size=1, max_size=4, unique=True))
    def load(self, keys):
        blocks = self.tier.load_run([SM_BLOCKS[key][0] for key in keys],
                                    [SM_BLOCKS[key][1] for key in keys])
        if not self.is_up:
            assert blocks == []
            return
        self.expected["num_fetches"] += 1
        served = 0
        for key in keys:
            if self.redis.get(key) is not True:
                if key in self.redis:  # damaged: counted, deleted
                    self.expected["num_rejected_blocks"] += 1
                    self.queued.append(("del", key))
                self.known.discard(key)
                self.missing.add(key)
                break
            self.known.add(key)
            self.missing.discard(key)
            served += 1
        assert len(blocks) == served, (keys, len(blocks), self.redis)
        for key, block in zip(keys, blocks, strict=False):
            _, _, kv, scales = SM_BLOCKS[key]
            assert same_bits(block.kv, kv) and same_bits(block.scales, scales)
        self.expected["num_loaded_blocks"] += served
        if self.queued and self.queued[-1][0] == "del":
            self.flush()  # the delete is the writer's: done before the next look at Redis

    # ------------------------------------------------------------ the world around it
    @precondition(lambda self: self.is_up and self.redis)
    @rule(data=st.data(), kind=st.sampled_from(DAMAGE))
    def damage(self, data, kind):
        key = data.draw(st.sampled_from(sorted(self.redis)))
        value = self.client.get(key_of(SM_LAYOUT, key))
        self.client.set(key_of(SM_LAYOUT, key), damaged_value(value, kind, SM_LAYOUT, key))
        self.redis[key] = False

    @precondition(lambda self: self.is_up and self.redis)
    @rule(data=st.data())
    def evict(self, data):
        """Redis's LRU drops a key: the tier may still think it is there."""
        key = data.draw(st.sampled_from(sorted(self.redis)))
        self.client.delete(key_of(SM_LAYOUT, key))
        del self.redis[key]

    @precondition(lambda self: self.is_up)
    @rule()
    def kill_redis(self):
        self.flush()  # the writer waits on no gate: its idle probe notices at once
        self.server.stop()
        assert wait_until(lambda: not self.tier.is_up)
        self.is_up = False
        self.expected["num_errors"] += 1

    @precondition(lambda self: not self.is_up)
    @rule()
    def restart_redis(self):
        self.server.start()  # empty
        assert wait_until(lambda: self.tier.is_up)
        self.client = self.server.client()
        self.redis.clear()
        self.known.clear()
        self.missing.clear()
        self.is_up = True
        self.expected["num_reconnects"] += 1

    # ------------------------------------------------------------ invariants
    @invariant()
    def counters_match_the_model(self):
        stats = self.tier.stats()
        assert {name: getattr(stats, name) for name in COUNTERS} == self.expected
        assert stats.is_up == self.is_up

    @invariant()
    def redis_holds_the_model_at_quiescence(self):
        if self.queued:
            return
        self.tier.check_invariants()
        if self.is_up:
            keys = {key.decode() for key in self.client.keys(f"{KEY_PREFIX}:*")}
            assert keys == {key_of(SM_LAYOUT, key) for key in self.redis}

    def teardown(self):
        self.gate.open()
        self.tier.close()
        if not self.is_up:
            self.server.start()


def test_the_shared_tier_keeps_to_its_model(redis_server):
    RedisTierMachine.server = redis_server
    run_state_machine_as_test(RedisTierMachine, settings=settings(
        max_examples=25, stateful_step_count=25, deadline=None))


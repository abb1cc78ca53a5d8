"""The shared KV tier against a real redis-server on loopback: round trips per dtype and how
many Redis calls they take, namespaces, damaged values, the write bound, Redis killed, hung
(SIGSTOP) and restarted, and the capacity warnings. The state machine is
test_redis_tier_machine; the engine and HTTP paths are tests/engine/test_shared_tier.py and
tests/server/test_shared_tier_http.py."""

from __future__ import annotations

import logging
import signal
import time

import pytest
from disk_checks import DTYPES, Gate, make_block, make_layout, same_bits
from redis_checks import DAMAGE, damaged_value, key_of, make_tier, wait_until

from kvpool.memory.tiers.redis_memo import PresenceMemo
from tests.redis_server import RedisServer


def shared_warnings(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records
            if record.name.startswith("kvpool.memory.tiers.redis")
            and record.levelno == logging.WARNING]


def store_all(tier, layout, keys) -> None:
    for key in keys:
        tier.store(*make_block(layout, key))
    assert tier.flush(timeout=10)


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("dtype", DTYPES)
def test_another_replica_loads_the_blocks_bit_exact_in_two_round_trips(redis_server, dtype):
    layout = make_layout(dtype)
    writer, reader = make_tier(redis_server.url, layout), make_tier(redis_server.url, layout)
    store_all(writer, layout, [0, 1, 2])
    blocks = [make_block(layout, key) for key in range(4)]
    hashes, tokens = [b[0] for b in blocks], [b[1] for b in blocks]
    assert reader.find(hashes) == [True, True, True, False]
    loaded = reader.load_run(hashes[:3], tokens[:3])
    assert [same_bits(got.kv, kv) and same_bits(got.scales, scales)
            for got, (_, _, kv, scales) in zip(loaded, blocks, strict=False)] == [True] * 3
    stats = reader.stats()
    assert (stats.num_lookups, stats.num_fetches, stats.num_loaded_blocks) == (1, 1, 3)
    assert stats.num_loaded_bytes == writer.stats().num_stored_bytes > 0
    assert reader.find(hashes) == [True, True, True, False]  # the memo answers: no call
    assert reader.stats().num_lookups == 1
    reader.store(*blocks[0])  # loaded from Redis: never written back
    assert reader.flush(timeout=5) and reader.stats().num_stored_blocks == 0
    for tier in (writer, reader):
        tier.check_invariants()
        tier.close()


def test_a_namespace_is_in_the_key_and_checked_in_the_value(redis_server):
    layout = make_layout("float32")
    ours, theirs = make_tier(redis_server.url, layout), make_tier(redis_server.url, layout, "other")
    store_all(theirs, layout, [1])
    block_hash, tokens, *_ = make_block(layout, 1)
    assert ours.find([block_hash]) == [False]
    client = redis_server.client()
    client.set(key_of(layout, 1), client.get(key_of(layout, 1, "other")))  # a copied value
    assert ours.load_run([block_hash], [tokens]) == []
    assert ours.flush(timeout=5) and ours.stats().num_rejected_blocks == 1
    assert client.exists(key_of(layout, 1)) == 0 and client.exists(key_of(layout, 1, "other"))
    ours.close()
    theirs.close()


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_value_ends_the_run_is_deleted_and_never_served(redis_server, kind):
    layout = make_layout("int8")
    tier = make_tier(redis_server.url, layout)
    store_all(tier, layout, [0, 1, 2])
    client = redis_server.client()
    client.set(key_of(layout, 1), damaged_value(client.get(key_of(layout, 1)), kind, layout, 1))
    blocks = [make_block(layout, key) for key in range(3)]
    loaded = tier.load_run([b[0] for b in blocks], [b[1] for b in blocks])
    assert len(loaded) == 1 and same_bits(loaded[0].kv, blocks[0][2])
    assert tier.flush(timeout=5)
    assert tier.stats().num_rejected_blocks == 1
    assert client.exists(key_of(layout, 1)) == 0 and client.exists(key_of(layout, 2)) == 1
    assert tier.find([blocks[1][0]]) == [False]  # forgotten, not assumed
    tier.close()


def test_the_wrong_tokens_under_a_good_hash_are_refused(redis_server):
    layout = make_layout("float32")
    tier = make_tier(redis_server.url, layout)
    store_all(tier, layout, [3])
    block_hash, tokens, *_ = make_block(layout, 3)
    assert tier.load_run([block_hash], [[*tokens[:-1], tokens[-1] + 1]]) == []
    assert tier.stats().num_rejected_blocks == 1
    tier.close()


# ---------------------------------------------------------------- writes
def test_queued_bytes_are_bounded_and_the_excess_is_dropped_and_counted(redis_server):
    layout = make_layout("float32")
    tier = make_tier(redis_server.url, layout, max_pending_bytes=2 * layout.bytes_per_block)
    gate = Gate()
    for key in range(4):
        tier.store(*make_block(layout, key), ready=gate)
    stats = tier.stats()
    assert stats.num_pending_bytes == 2 * layout.bytes_per_block
    assert stats.num_dropped_writes == 2
    gate.open()
    assert tier.flush(timeout=5)
    assert tier.stats().num_stored_blocks == 2 and redis_server.client().dbsize() == 2
    tier.check_invariants()
    tier.close()


def test_a_value_in_redis_is_never_overwritten_only_known(redis_server):
    """Keys are content-addressed: a second write of a hash (other KV under it, as a failed
    step once produced) keeps the first value (SET NX) and is neither stored nor dropped."""
    layout = make_layout("float32")
    first, second = make_tier(redis_server.url, layout), make_tier(redis_server.url, layout)
    store_all(first, layout, [0])
    client = redis_server.client()
    value = client.get(key_of(layout, 0))
    block_hash, tokens, kv, scales = make_block(layout, 0)
    second.store(block_hash, tokens, kv + 1, scales)
    assert second.flush(timeout=5)
    assert client.get(key_of(layout, 0)) == value
    stats = second.stats()
    assert (stats.num_stored_blocks, stats.num_dropped_writes) == (0, 0)
    assert second.wanted([block_hash]) == set()  # known to be there now
    [loaded] = second.load_run([block_hash], [tokens])
    assert same_bits(loaded.kv, kv)
    for tier in (first, second):
        tier.check_invariants()
        tier.close()


def test_close_waits_a_bounded_time_on_a_hung_redis(redis_server):
    layout = make_layout("float32")
    tier = make_tier(redis_server.url, layout)
    gate = Gate()
    tier.store(*make_block(layout, 0), ready=gate)
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        gate.open()
        start = time.monotonic()
        tier.close(timeout=2)
        assert time.monotonic() - start < 2
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    stats = tier.stats()
    assert stats.num_dropped_writes == 1 and stats.num_errors == 1 and not stats.is_up


# ---------------------------------------------------------------- outages
def test_killed_redis_degrades_to_nothing_then_comes_back(redis_server, caplog):
    layout = make_layout("int8")
    tier = make_tier(redis_server.url, layout)
    store_all(tier, layout, [0])
    redis_server.stop()
    assert wait_until(lambda: not tier.is_up)  # the idle probe notices
    hashes = [make_block(layout, key)[0] for key in range(2)]
    assert tier.find(hashes) == [False, False]
    assert tier.load_run(hashes, [make_block(layout, key)[1] for key in range(2)]) == []
    assert tier.wanted(hashes[1:]) == set()  # counted as dropped
    tier.store(*make_block(layout, 1))  # dropped too
    stats = tier.stats()
    assert stats.num_errors == 1 and stats.num_dropped_writes == 2
    assert len(shared_warnings(caplog)) == 1 and "down" in shared_warnings(caplog)[0]
    redis_server.start()  # empty, on the same port
    assert wait_until(lambda: tier.is_up)
    assert tier.stats().num_reconnects == 1 and "reconnected" in shared_warnings(caplog)[-1]
    assert tier.find(hashes) == [False, False]  # the memo was cleared with the old Redis
    store_all(tier, layout, [0, 1])  # block 0 again: no longer assumed to be there
    assert tier.find(hashes) == [True, True] and redis_server.client().dbsize() == 2
    tier.check_invariants()
    tier.close()


def test_a_redis_restarted_between_calls_is_noticed_and_its_lost_blocks_written_again(
        redis_server, caplog):
    """No outage is seen (the client reconnects on its own, no probe runs in between), but the
    new Redis has a new run_id: the memo goes, so the blocks it lost are written again."""
    layout = make_layout("float32")
    tier = make_tier(redis_server.url, layout, probe_interval=3600)  # no idle probe here
    store_all(tier, layout, [0])
    hashes = [make_block(layout, key)[0] for key in range(2)]
    assert tier.wanted(hashes[:1]) == set()  # known to be in Redis
    redis_server.stop()
    redis_server.start()  # empty, on the same port
    assert tier.find(hashes[1:]) == [False]  # a call: the client reconnects transparently
    stats = tier.stats()
    assert stats.is_up and (stats.num_errors, stats.num_reconnects) == (0, 0)
    assert tier.wanted(hashes[:1]) == {hashes[0]}  # lost with the old Redis: wanted again
    assert tier.link.num_restarts == 1 and "restarted" in shared_warnings(caplog)[-1]
    store_all(tier, layout, [0])
    assert redis_server.client().exists(key_of(layout, 0)) == 1
    tier.check_invariants()
    tier.close()


def test_a_hung_redis_costs_one_timeout_then_nothing_until_it_answers(redis_server, caplog):
    layout = make_layout("float32")
    tier = make_tier(redis_server.url, layout, timeout=0.3, probe_interval=1.0)  # probe later
    block_hash = make_block(layout, 0)[0]
    redis_server.process.send_signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert tier.find([block_hash]) == [False]
        assert 0.25 < time.monotonic() - start < 1.0  # one timeout, no retry
        start = time.monotonic()
        for _ in range(100):
            tier.find([block_hash])
        assert time.monotonic() - start < 0.1  # down: no call at all
    finally:
        redis_server.process.send_signal(signal.SIGCONT)
    assert wait_until(lambda: tier.is_up)
    assert tier.stats().num_errors == 1 and len(shared_warnings(caplog)) == 2
    tier.close()


def test_an_unreachable_redis_at_start_is_a_warning_not_an_error(tmp_path, caplog):
    server = RedisServer(tmp_path / "later")  # its port, nobody listening yet
    tier = make_tier(server.url, make_layout("float32"))
    assert not tier.is_up and len(shared_warnings(caplog)) == 1
    server.start()
    try:
        assert wait_until(lambda: tier.is_up)
    finally:
        tier.close()
        server.stop()


# ---------------------------------------------------------------- capacity
def test_unbounded_or_non_lru_redis_is_warned_about_and_refused_config_ignored(
        redis_server, caplog):
    client = redis_server.client()
    client.config_set("maxmemory", 0)
    client.config_set("maxmemory-policy", "noeviction")
    make_tier(redis_server.url, make_layout("float32")).close()
    warnings = shared_warnings(caplog)
    assert len(warnings) == 2 and "maxmemory 0" in warnings[0] and "noeviction" in warnings[1]
    caplog.clear()
    client.acl_setuser("managed", enabled=True, passwords=["+pw"], keys=["*"],
                       commands=["+@all", "-config"])
    url = redis_server.url.replace("redis://", "redis://managed:pw@")
    managed = make_tier(url, make_layout("float32"))
    assert managed.is_up and shared_warnings(caplog) == []
    managed.close()


def test_the_memo_is_bounded_and_forgets_misses_after_their_ttl():
    memo = PresenceMemo(max_size=2, ttl=1.0)
    for index in range(3):
        memo.remember(bytes([index]) * 32, True, now=0.0)
        memo.remember(bytes([index + 10]) * 32, False, now=0.0)
    assert len(memo) == 2 and not memo.is_known(bytes([0]) * 32)
    assert memo.lookup(bytes([12]) * 32, now=0.5) is False
    assert memo.lookup(bytes([12]) * 32, now=1.5) is None
    memo.remember(bytes([1]) * 32, False, now=2.0)  # a stale known one
    assert memo.lookup(bytes([1]) * 32, now=2.0) is False
    memo.check_invariants()

"""The shared KV tier end to end: two engines (replicas) over the one SmolLM2 model and a real
redis-server. A prefix one replica computed is served to the other from Redis, token-identical
to a cold run; tenants, KV dtypes and damaged values never cross; Redis killed mid-run loses no
request, and once restarted the tier writes and serves again. Every engine is leak- and
invariant-checked after each test (`make_engine`)."""

from __future__ import annotations

import logging
import time

import pytest

from kvpool.engine.sampling_params import SamplingParams
from kvpool.formats.kv_snapshot import KVSnapshot
from kvpool.memory.prefix_cache import hash_full_blocks
from kvpool.memory.tiers.disk_block_format import decode_block, encode_block
from kvpool.memory.tiers.redis_tier import shared_key

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
MANUAL = ("The tide tables list high and low water for every day of the year. Moorings are "
          "assigned by the harbour office, and no vessel may anchor in the channel. ") * 2
PILOTAGE = ("Pilots board inbound ships at the fairway buoy and leave them at the berth; a ship "
            "longer than sixty metres must take a pilot in any weather. ") * 2
BERTHS = ("Berths one to four take ferries and fishing boats; berths five to nine are kept for "
          "cargo ships, which must report their draught before they enter. ") * 2


def prompt(question: str, manual: str = MANUAL) -> str:
    return manual + question


def replica(make_engine, redis_server, **options):
    return make_engine(dtype="float32", num_gpu_blocks=64, enable_warmup=False,
                       kv_shared_redis=redis_server.url, **options)


def served(engine, text: str, cache_salt: str | None = None):
    """The finished output of `text` run alone on `engine`."""
    request = engine.add_request(text, GREEDY, cache_salt=cache_salt)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request.request_id and output.finished:
                final = output
    return final


def num_full_prompt_tokens(output, block_size: int = 16) -> int:
    """The prompt tokens a prefix cache can serve: whole blocks, all but the last token."""
    return (len(output.prompt_token_ids) - 1) // block_size * block_size


def test_a_replica_serves_the_other_replicas_prefix_from_redis(make_engine, redis_server):
    first_replica, second_replica = (replica(make_engine, redis_server) for _ in range(2))
    cold = served(first_replica, prompt("When is high water?"))
    assert cold.num_cached_tokens == 0
    assert first_replica.kv_tiers.shared.flush(timeout=10)
    warm = served(second_replica, prompt("When is high water?"))
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    num_cached = num_full_prompt_tokens(cold)
    assert warm.num_cached_tokens == num_cached > 0
    assert second_replica.stats().cached_tokens_by_tier == {
        "device": 0, "host": 0, "disk": 0, "shared": num_cached}
    shared = second_replica.kv_tier_stats().shared
    assert (shared.num_lookups, shared.num_fetches) == (1, 1)  # one EXISTS, one MGET
    assert shared.num_loaded_blocks == num_cached // 16
    assert second_replica.kv_tier_stats().num_reloaded_blocks["shared"] == num_cached // 16
    assert second_replica.kv_tiers.shared.flush(timeout=10)
    stored = first_replica.kv_tier_stats().shared.num_stored_blocks
    assert second_replica.kv_tier_stats().shared.num_stored_blocks == (
        stored - num_cached // 16)  # what it loaded from Redis is not written back
    snapshot = second_replica.kv_snapshot()
    assert snapshot.shared == {"is_up": 1, "num_stored_blocks": stored - num_cached // 16,
                               "num_loaded_blocks": num_cached // 16}
    assert KVSnapshot.from_json(snapshot.to_json()).shared == snapshot.shared


def test_other_tenants_and_other_kv_dtypes_miss_in_redis(make_engine, redis_server):
    writer = replica(make_engine, redis_server)
    text = prompt("Where may a yacht moor?")
    served(writer, text, cache_salt="tenant-a")
    assert writer.kv_tiers.shared.flush(timeout=10)
    other = replica(make_engine, redis_server)
    assert served(other, text, cache_salt="tenant-b").num_cached_tokens == 0
    assert served(other, text, cache_salt="tenant-a").num_cached_tokens > 0
    assert other.stats().cached_tokens_by_tier["shared"] > 0
    int8 = replica(make_engine, redis_server, kv_cache_dtype="int8")  # its namespace differs
    assert served(int8, text, cache_salt="tenant-a").num_cached_tokens == 0
    shared = int8.kv_tier_stats().shared
    assert shared.num_loaded_blocks == shared.num_rejected_blocks == 0  # never even matched


def test_requests_survive_redis_going_away_and_the_tier_comes_back(
        make_engine, redis_server, caplog):
    engine = replica(make_engine, redis_server, kv_shared_redis_timeout=0.2)
    served(engine, prompt("Who pilots the ferry?"))
    redis_server.stop()
    during = served(engine, prompt("Is the lock open at night?", PILOTAGE))  # new blocks
    assert during.finished and len(during.outputs[0].token_ids) == GREEDY.max_tokens
    shared = engine.kv_tier_stats().shared
    assert not shared.is_up and shared.num_errors >= 1 and shared.num_dropped_writes > 0
    warnings = [record.getMessage() for record in caplog.records
                if record.levelno == logging.WARNING and "shared KV tier" in record.getMessage()]
    assert len(warnings) == 1 and "shared KV tier is down" in warnings[0]
    redis_server.start()  # empty: a restart without persistence
    assert wait_for(lambda: engine.kv_tiers.shared.is_up)
    assert engine.kv_tier_stats().shared.num_reconnects == 1
    # A new prefix: the blocks published before the outage are on the device, not re-sent.
    after = served(engine, prompt("What does the red flag mean?", BERTHS))
    assert engine.kv_tiers.shared.flush(timeout=10) and redis_server.client().dbsize() > 0
    other = replica(make_engine, redis_server)
    again = served(other, prompt("What does the red flag mean?", BERTHS))
    assert again.outputs[0].token_ids == after.outputs[0].token_ids
    assert other.stats().cached_tokens_by_tier["shared"] == num_full_prompt_tokens(after) > 0


def test_damaged_values_in_redis_are_rejected_deleted_and_never_served(
        make_engine, redis_server):
    writer = replica(make_engine, redis_server)
    text = prompt("May I anchor in the channel?")
    cold = served(writer, text)
    assert writer.kv_tiers.shared.flush(timeout=10)
    tier, client = writer.kv_tiers.shared, redis_server.client()
    first_block = cold.prompt_token_ids[:16]
    [block_hash] = hash_full_blocks(first_block, 16)
    key = shared_key(tier.namespace, block_hash)
    good = client.get(key)
    block = decode_block(good, tier.layout, tier.namespace, block_hash, first_block)
    other_tokens = encode_block(tier.namespace, block_hash, [token + 1 for token in first_block],
                                block.kv, block.scales)
    flipped = bytearray(good)
    flipped[-5] ^= 0x01
    for damaged in (bytes(flipped), good[: len(good) // 3], other_tokens):
        client.set(key, damaged)
        reader = replica(make_engine, redis_server)
        output = served(reader, text)
        assert output.outputs[0].token_ids == cold.outputs[0].token_ids
        assert output.num_cached_tokens == 0  # the chain ends at its first block
        assert reader.kv_tiers.shared.flush(timeout=10)
        assert reader.kv_tier_stats().shared.num_rejected_blocks == 1
        assert client.get(key) != damaged  # deleted (then written again by the reader)


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True

"""GET /v1/kv/events and /v1/kv/events/snapshot on real servers, and a router-side subscriber
following one over real ZMQ and HTTP: gaps resync from the real snapshot, after which its
index equals what the engine holds."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest

from kvpool.engine.observability.event_log import KVEventLog
from kvpool.formats.kv_events_curve import generate_key_pair
from kvpool.memory.prefix_cache import hash_full_blocks, salt_key
from kvpool.openai.auth import ApiKeyTable, TenantSalts
from kvpool.router.kv_event_subscriber import (
    KVEventSubscriber,
    fetch_event_snapshot,
    fetch_event_source,
)
from kvpool.router.prefix_index import PrefixIndex
from kvpool.router.replica_events import subscribe as subscribe_to_replica
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, RunningServer

EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://*:*", "topic": "kv"}
ADMIN = {"Authorization": "Bearer admin-key"}
ALICE = {"Authorization": "Bearer alice-key"}
SALTS = TenantSalts.resolve()  # the suite's secret (tests/conftest.py), as the servers'


def keyed_config() -> ServerConfig:
    return ServerConfig(served_model_names=(MODEL,),
                        api_keys=ApiKeyTable.from_keys([("alice", "alice-key")]),
                        admin_api_keys=ApiKeyTable.from_keys([("admin", "admin-key")]))


def complete(server: RunningServer, prompt: list[int], headers: dict[str, str]) -> None:
    response = httpx.post(f"{server.base_url}/v1/completions", headers=headers, timeout=60,
                          json={"model": MODEL, "prompt": prompt, "max_tokens": 2,
                                "temperature": 0})
    response.raise_for_status()


def wait_for(condition: Callable[[], bool], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_events_route_says_where_it_publishes(make_server) -> None:
    server = make_server(block_size=4, kv_events_config=EVENTS)
    doc = httpx.get(f"{server.base_url}/v1/kv/events").json()
    assert doc["endpoint"].startswith("tcp://0.0.0.0:") and not doc["endpoint"].endswith(":*")
    assert {k: doc[k] for k in ("enabled", "publisher", "topic", "block_size", "seq")} == {
        "enabled": True, "publisher": "zmq", "topic": "kv", "block_size": 4, "seq": 0}
    source = fetch_event_source(server.base_url)
    assert source.endpoint == doc["endpoint"].replace("0.0.0.0", "127.0.0.1")
    assert (source.topic, source.block_size) == ("kv", 4)


def test_with_events_off_there_is_no_source_and_no_snapshot(make_server) -> None:
    server = make_server()
    assert httpx.get(f"{server.base_url}/v1/kv/events").json()["enabled"] is False
    response = httpx.get(f"{server.base_url}/v1/kv/events/snapshot")
    assert response.status_code == 404
    assert "--kv-events-config" in response.json()["error"]["message"]
    assert fetch_event_source(server.base_url) is None
    pool = server.engine.engine.kv_memory.pool
    assert not any(isinstance(listener, KVEventLog) for listener in pool.listeners)


def test_the_null_publisher_numbers_batches_but_binds_nothing(make_server) -> None:
    server = make_server(block_size=4, kv_events_config={**EVENTS, "publisher": "null"})
    prompt = list(range(300, 309))
    complete(server, prompt, {})
    doc = httpx.get(f"{server.base_url}/v1/kv/events").json()
    assert (doc["publisher"], doc["endpoint"], doc["seq"]) == ("null", None, 1)
    assert fetch_event_source(server.base_url) is None
    snapshot = fetch_event_snapshot(server.base_url)
    expected = hash_full_blocks(prompt, 4, salt_key(SALTS.cache_salt("default", None)))
    assert snapshot.seq == 1 and sorted(snapshot.blocks) == sorted(
        (block_hash, "device") for block_hash in expected)


def test_with_keys_both_routes_take_the_admin_key_only(make_server) -> None:
    server = make_server(keyed_config(), block_size=4, kv_events_config=EVENTS)
    for path in ("/v1/kv/events", "/v1/kv/events/snapshot"):
        url = f"{server.base_url}{path}"
        assert httpx.get(url).status_code == 401
        refused = httpx.get(url, headers=ALICE)
        assert refused.status_code == 403 and "admin" in refused.json()["error"]["message"]
        assert httpx.get(url, headers=ADMIN).status_code == 200


def test_a_subscriber_follows_the_server_and_resyncs_from_its_snapshot(make_server) -> None:
    server = make_server(keyed_config(), num_gpu_blocks=24, block_size=4,
                         kv_events_config=EVENTS)
    source = fetch_event_source(server.base_url, ADMIN)
    index = PrefixIndex()
    subscriber = KVEventSubscriber(source, index,
                                   lambda: fetch_event_snapshot(server.base_url, ADMIN))
    subscriber.start()
    try:
        assert subscriber.wait_synced(10)

        def follows() -> bool:
            snapshot = fetch_event_snapshot(server.base_url, ADMIN)  # drains: a new batch
            return (subscriber.stats().last_seq >= snapshot.seq
                    and index.blocks() == set(snapshot.blocks))

        prompt = list(range(1000, 1021))
        complete(server, prompt, ALICE)
        wait_for(follows)
        hashes = hash_full_blocks(prompt, 4, salt_key(SALTS.cache_salt("alice", None)))
        assert index.longest_prefix(hashes) == 5
        as_bob = hash_full_blocks(prompt, 4, salt_key(SALTS.cache_salt("bob", None)))
        assert index.longest_prefix(as_bob) == 0
        assert subscriber.stats().num_gaps == 0

        def skip_a_seq(engine) -> None:
            engine.kv_events.seq += 1  # the batch after it is never published: a gap

        asyncio.run(server.engine.call_on_engine(skip_a_seq))
        for start in range(2000, 2200, 20):  # 10 prompts of 5 blocks: evictions from 24
            complete(server, list(range(start, start + 21)), ALICE)
        wait_for(follows)
        stats = subscriber.stats()
        assert stats.num_gaps == 1 and stats.num_resyncs == 2 and stats.is_synced
        assert 0 < len(index) <= 24
        assert index.longest_prefix(hashes) == 0  # evicted long since
    finally:
        subscriber.stop()


def test_a_curve_replica_is_followed_by_a_router_holding_a_listed_key(make_server,
                                                                      tmp_path) -> None:
    replica_key = generate_key_pair(tmp_path, "replica")[1]
    router_public, router_secret = generate_key_pair(tmp_path, "router")
    events = {**EVENTS, "endpoint": "tcp://127.0.0.1:*",
              "curve_secret_key_file": str(replica_key),
              "curve_client_keys": [str(router_public)]}
    server = make_server(keyed_config(), block_size=4, kv_events_config=events)
    doc = httpx.get(f"{server.base_url}/v1/kv/events", headers=ADMIN).json()
    assert len(doc["curve_public_key"]) == 40
    with pytest.raises(ValueError, match="requires CURVE"):
        subscribe_to_replica(server.base_url, "admin-key")
    feed = subscribe_to_replica(server.base_url, "admin-key", str(router_secret))
    try:
        assert feed.subscriber.wait_synced(15)
        prompt = list(range(700, 709))
        complete(server, prompt, ALICE)
        hashes = hash_full_blocks(prompt, 4, salt_key(SALTS.cache_salt("alice", None)))
        wait_for(lambda: feed.index.longest_prefix(hashes) == 2)
    finally:
        feed.stop()

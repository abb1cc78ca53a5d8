"""ZMQ CURVE on the KV event socket, over real sockets on loopback: a subscriber whose key the
replica lists receives the batches (and the router's `KVEventSubscriber` follows them); one
without CURVE, or with a key not on the list, receives nothing while the listed one does."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from kvpool.engine.observability.events_config import KVEventsConfig
from kvpool.engine.observability.publisher import ZmqEventPublisher
from kvpool.formats.kv_events import BlockStored, EventSnapshot, KVEventBatch, decode_message
from kvpool.formats.kv_events_curve import generate_key_pair, load_public_key, make_curve_client
from kvpool.router.kv_event_subscriber import EventSource, KVEventSubscriber
from kvpool.router.prefix_index import PrefixIndex

H = [bytes([i]) * 32 for i in range(8)]
WAIT_SECONDS = 15.0  # generous: the machine may be busy


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, tuple[Path, Path]]:
    return {name: generate_key_pair(tmp_path, name) for name in ("replica", "router", "stranger")}


@pytest.fixture
def publisher(keys) -> Iterator[ZmqEventPublisher]:
    config = KVEventsConfig(True, endpoint="tcp://127.0.0.1:*", topic="kv",
                            curve_secret_key_file=str(keys["replica"][1]),
                            curve_client_keys=(str(keys["router"][0]),))
    running = ZmqEventPublisher(config)
    yield running
    running.close()


def sub_socket(endpoint: str, secret_file: Path | None, server_key: str | None) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv")
    if secret_file is not None:
        make_curve_client(socket, secret_file, server_key)
    socket.connect(endpoint)
    return socket


def batch(index: int) -> KVEventBatch:
    return KVEventBatch(time.time(), [BlockStored([H[index]], None, [], 4, None, "device")])


def test_only_a_listed_curve_key_receives_the_events(publisher, keys) -> None:
    server_key = publisher.curve_public_key
    assert server_key is not None and load_public_key(server_key) == load_public_key(
        str(keys["replica"][0]))
    listed = sub_socket(publisher.endpoint, keys["router"][1], server_key)
    stranger = sub_socket(publisher.endpoint, keys["stranger"][1], server_key)
    plain = sub_socket(publisher.endpoint, None, None)
    received: dict[str, list[int]] = {"listed": [], "stranger": [], "plain": []}
    sockets = {"listed": listed, "stranger": stranger, "plain": plain}
    deadline, seq = time.monotonic() + WAIT_SECONDS, 0
    # Publish until the listed subscriber has had 20 batches (ZMQ's slow joiner drops the
    # first ones): the others were connected all that time.
    while len(received["listed"]) < 20 and time.monotonic() < deadline:
        seq += 1
        publisher.publish(seq, batch(seq % len(H)))
        for name, socket in sockets.items():
            while socket.poll(10):
                received[name].append(decode_message(socket.recv_multipart())[0])
    for socket in sockets.values():
        socket.close(linger=0)
    assert len(received["listed"]) >= 20
    assert received["listed"] == sorted(received["listed"])
    assert received["stranger"] == [] and received["plain"] == []


def test_the_router_subscriber_follows_a_curve_replica(publisher, keys) -> None:
    source = EventSource(publisher.endpoint, "kv", 4, publisher.curve_public_key)
    with pytest.raises(ValueError, match="requires CURVE"):
        KVEventSubscriber(source, PrefixIndex(), lambda: EventSnapshot(0, []))
    index = PrefixIndex()
    subscriber = KVEventSubscriber(source, index, lambda: EventSnapshot(0, []), name="curve",
                                   curve_secret_key_file=str(keys["router"][1]))
    subscriber.start()
    try:
        assert subscriber.wait_synced(WAIT_SECONDS)
        publisher.publish(1, batch(3))
        deadline = time.monotonic() + WAIT_SECONDS
        while subscriber.stats().num_batches < 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert index.blocks() == {(H[3], "device")}
    finally:
        subscriber.stop()


def test_bad_curve_settings_are_clear_errors(keys) -> None:
    with pytest.raises(ValueError, match="curve_client_keys needs curve_secret_key_file"):
        KVEventsConfig(True, curve_client_keys=("x" * 40,))
    with pytest.raises(ValueError, match="neither a Z85 CURVE public key nor a key file"):
        load_public_key("no-such-key")
    config = KVEventsConfig(True, endpoint="tcp://127.0.0.1:*",
                            curve_secret_key_file=str(keys["router"][0]),  # public only
                            curve_client_keys=(str(keys["router"][0]),))
    with pytest.raises(ValueError, match="holds no CURVE secret key"):
        ZmqEventPublisher(config)

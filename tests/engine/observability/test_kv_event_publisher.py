"""ZmqEventPublisher: binds (a `*` port: any free one, reported), never loses the newest batch
to its bounded queue, counts every drop, sends what is queued at close; a taken address is a
clear error."""

from __future__ import annotations

import time

import pytest
import zmq

from kvpool.engine.observability.events_config import KVEventsConfig
from kvpool.engine.observability.publisher import NullEventPublisher, ZmqEventPublisher
from kvpool.formats.kv_events import AllBlocksCleared, KVEventBatch, decode_message

BATCH = KVEventBatch(0.0, [AllBlocksCleared()])


def config(**options) -> KVEventsConfig:
    return KVEventsConfig(True, **{"endpoint": "tcp://127.0.0.1:*", "topic": "kv", **options})


def test_a_burst_through_a_one_batch_queue_keeps_order_and_the_newest() -> None:
    publisher = ZmqEventPublisher(config(max_queue_size=1))
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(publisher.endpoint)
    time.sleep(0.2)  # the subscription reaches the publisher
    for seq in range(1, 1001):
        publisher.publish(seq, BATCH)
    publisher.close()
    stats = publisher.stats()
    assert stats.num_batches_published + stats.num_batches_dropped == 1000
    assert stats.num_events_published == stats.num_batches_published
    seqs = []
    while subscriber.poll(200):
        seqs.append(decode_message(subscriber.recv_multipart())[0])
    subscriber.close(linger=0)
    assert len(seqs) == stats.num_batches_published
    assert seqs == sorted(seqs) and seqs[-1] == 1000  # drops are the oldest, never the newest
    publisher.publish(1001, BATCH)  # after close: counted, not sent
    assert publisher.stats().num_batches_dropped == stats.num_batches_dropped + 1


def test_a_taken_address_is_a_value_error_naming_it() -> None:
    first = ZmqEventPublisher(config())
    try:
        assert first.endpoint.startswith("tcp://127.0.0.1:")
        with pytest.raises(ValueError, match="cannot bind"):
            ZmqEventPublisher(config(endpoint=first.endpoint))
    finally:
        first.close()


def test_the_null_publisher_counts_and_binds_nothing() -> None:
    publisher = NullEventPublisher()
    publisher.publish(1, BATCH)
    assert publisher.endpoint is None
    assert publisher.stats().num_events_published == 1

"""KVEventSubscriber over a real ZMQ PUB socket (`ZmqEventPublisher`): it applies batches in
sequence, resyncs at start, on a gap, on a restart's seq and after a lost connection, skips
what a snapshot already includes, and survives failing snapshot fetches. The snapshot source
here is a function over a dict the test keeps as the publisher's truth; the real HTTP
snapshot is exercised in tests/server/test_kv_event_routes.py."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from kvpool.engine.observability.events_config import KVEventsConfig
from kvpool.engine.observability.publisher import ZmqEventPublisher
from kvpool.formats.kv_events import BlockRemoved, BlockStored, EventSnapshot, KVEventBatch
from kvpool.router.kv_event_subscriber import EventSource, KVEventSubscriber, SubscriberStats
from kvpool.router.prefix_index import PrefixIndex

H = [bytes([i]) * 32 for i in range(64)]


class Replica:
    """A publisher and the truth it publishes: `held` as of batch `seq`."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:*") -> None:
        self.publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=endpoint, topic="kv"))
        self.held: set[tuple[bytes, str]] = set()
        self.seq = 0
        self.num_failing_fetches = 0
        self.num_fetches = 0

    def store(self, *indices: int, publish: bool = True) -> None:
        """The next batch stores H[i] on the device; `publish=False` loses it on the way."""
        self.seq += 1
        self.held |= {(H[i], "device") for i in indices}
        if publish:
            event = BlockStored([H[i] for i in indices], None, [1] * 4 * len(indices), 4,
                                None, "device")
            self.publisher.publish(self.seq, KVEventBatch(time.time(), [event]))

    def remove(self, *indices: int) -> None:
        self.seq += 1
        self.held -= {(H[i], "device") for i in indices}
        event = BlockRemoved([H[i] for i in indices], "device")
        self.publisher.publish(self.seq, KVEventBatch(time.time(), [event]))

    def snapshot(self) -> EventSnapshot:
        self.num_fetches += 1
        if self.num_failing_fetches:
            self.num_failing_fetches -= 1
            raise ConnectionError("replica down")
        return EventSnapshot(self.seq, sorted(self.held))


@pytest.fixture
def replica() -> Iterator[Replica]:
    running = Replica()
    yield running
    running.publisher.close()


@pytest.fixture
def subscribe() -> Iterator[Callable[[Replica], tuple[KVEventSubscriber, PrefixIndex]]]:
    subscribers: list[KVEventSubscriber] = []

    def start(replica: Replica) -> tuple[KVEventSubscriber, PrefixIndex]:
        index = PrefixIndex()
        source = EventSource(replica.publisher.endpoint, "kv", 4)
        subscriber = KVEventSubscriber(source, index, lambda: replica.snapshot(), name="test")
        subscriber.start()
        subscribers.append(subscriber)
        assert subscriber.wait_synced(10)
        return subscriber, index

    yield start
    for subscriber in subscribers:
        subscriber.stop()


def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def follows(subscriber: KVEventSubscriber, index: PrefixIndex, replica: Replica) -> bool:
    stats = subscriber.stats()
    return stats.is_synced and stats.last_seq == replica.seq and index.blocks() == replica.held


def test_applies_batches_in_sequence_after_the_first_resync(replica, subscribe) -> None:
    replica.store(0, 1)  # before the subscriber: the snapshot has it
    subscriber, index = subscribe(replica)
    replica.store(2, 3)
    replica.remove(0)
    wait_for(lambda: follows(subscriber, index, replica))
    assert subscriber.stats() == SubscriberStats(num_batches=2, num_events=2, num_gaps=0,
                                                 num_resyncs=1, last_seq=3, is_synced=True)
    assert index.longest_prefix([H[1], H[2], H[3], H[0]]) == 3


def test_a_skipped_seq_is_a_gap_and_resyncs(replica, subscribe) -> None:
    subscriber, index = subscribe(replica)
    replica.store(0)
    replica.store(1, publish=False)  # lost: seq 2 never arrives
    replica.store(2)
    wait_for(lambda: follows(subscriber, index, replica))
    stats = subscriber.stats()
    assert (stats.num_gaps, stats.num_resyncs) == (1, 2)
    assert index.blocks() == {(H[0], "device"), (H[1], "device"), (H[2], "device")}


def test_a_restarted_replica_counting_from_one_resyncs(replica, subscribe) -> None:
    subscriber, index = subscribe(replica)
    replica.store(0)
    replica.store(1)
    wait_for(lambda: follows(subscriber, index, replica))
    replica.seq, replica.held = 0, set()  # the replica restarts: empty, counting from 1
    replica.store(5)
    wait_for(lambda: follows(subscriber, index, replica))
    assert index.blocks() == {(H[5], "device")}
    assert subscriber.stats().num_gaps == 1


def test_batches_the_snapshot_includes_are_skipped(replica, subscribe) -> None:
    """Batches queued in the socket while the snapshot was fetched are already in it."""
    subscriber, index = subscribe(replica)
    fetch = replica.snapshot

    def slow_snapshot() -> EventSnapshot:
        replica.store(10)
        replica.store(11)
        time.sleep(0.2)  # both arrive while the snapshot is being taken
        return fetch()

    replica.snapshot = slow_snapshot
    replica.store(0, publish=False)  # a gap: the next batch makes it resync
    replica.store(1)
    wait_for(lambda: subscriber.stats().num_resyncs == 2)
    replica.snapshot = fetch
    replica.store(12)
    wait_for(lambda: follows(subscriber, index, replica))
    stats = subscriber.stats()
    assert (stats.num_gaps, stats.num_resyncs) == (1, 2)  # 10 and 11 were skipped, not gaps


def test_failed_snapshot_fetches_are_retried(replica, subscribe) -> None:
    replica.num_failing_fetches = 3
    replica.store(0)
    subscriber, index = subscribe(replica)  # synced only once the fourth fetch worked
    assert replica.num_fetches == 4
    assert subscriber.stats().num_resyncs == 1 and index.blocks() == replica.held


def test_a_lost_connection_resyncs_once_the_replica_is_back(replica, subscribe) -> None:
    subscriber, index = subscribe(replica)
    replica.store(0)
    wait_for(lambda: follows(subscriber, index, replica))
    endpoint = replica.publisher.endpoint
    replica.publisher.close()  # the replica goes away, and comes back on the same port
    wait_for(lambda: not subscriber.stats().is_synced)
    replica.publisher = ZmqEventPublisher(KVEventsConfig(True, endpoint=endpoint, topic="kv"))
    replica.seq, replica.held = 0, {(H[7], "host")}
    wait_for(lambda: follows(subscriber, index, replica))
    assert subscriber.stats().num_resyncs == 2


def test_stop_returns_promptly_and_start_resyncs(replica, subscribe) -> None:
    subscriber, index = subscribe(replica)
    started = time.monotonic()
    subscriber.stop()
    assert time.monotonic() - started < 1.0
    replica.store(3)  # published while nobody listens
    subscriber.start()
    wait_for(lambda: follows(subscriber, index, replica))
    assert subscriber.stats().num_resyncs == 2


def test_other_topics_under_the_prefix_are_ignored(subscribe) -> None:
    other = Replica()
    other.publisher.topic = "kv-other"
    try:
        subscriber, index = subscribe(other)
        other.store(0)
        time.sleep(0.3)
        assert subscriber.stats().num_batches == 0 and len(index) == 0
    finally:
        other.publisher.close()

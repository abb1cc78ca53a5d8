"""One replica's KV-event feed in the router: its `PrefixIndex`, kept by a `KVEventSubscriber`.

`subscribe` asks the replica where it publishes (`GET /v1/kv/events`, with the replicas' admin
key when one is given) and starts a subscriber that fills a fresh index, resyncing from the
replica's snapshot whenever it sees a gap. A replica that publishes nothing gets no feed (it is
still routed to, by load). Both calls block (HTTP, a thread's start and join): the router runs
them in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvpool.router.kv_event_subscriber import (
    KVEventSubscriber,
    SubscriberStats,
    fetch_event_snapshot,
    fetch_event_source,
)
from kvpool.router.prefix_index import PrefixIndex


@dataclass(frozen=True, slots=True)
class ReplicaEvents:
    index: PrefixIndex  # the blocks the replica holds, as its events tell (thread-safe)
    subscriber: KVEventSubscriber
    block_size: int  # the replica's, from its event source

    def stats(self) -> SubscriberStats:
        return self.subscriber.stats()

    def stop(self) -> None:
        self.subscriber.stop()
        self.index.clear()


def subscribe(url: str, admin_key: str | None,
              curve_secret_key_file: str | None = None) -> ReplicaEvents | None:
    """The replica's feed, started; None when it publishes no events. Raises what the HTTP
    calls raise (an unreachable replica, a refused key), and ValueError for a replica that
    requires CURVE when the router has no key pair."""
    headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
    source = fetch_event_source(url, headers)
    if source is None:
        return None
    index = PrefixIndex()
    subscriber = KVEventSubscriber(source, index, lambda: fetch_event_snapshot(url, headers),
                                   name=url, curve_secret_key_file=curve_secret_key_file)
    subscriber.start()
    return ReplicaEvents(index, subscriber, source.block_size)

"""The consumer side of a replica's KV events: where it publishes, its snapshot, a subscriber.

    fetch_event_source     GET /v1/kv/events           -> EventSource (None: no events)
    fetch_event_snapshot   GET /v1/kv/events/snapshot  -> EventSnapshot(seq, blocks)
    KVEventSubscriber      a daemon thread: SUB socket -> PrefixIndex, resyncing on gaps

The subscriber's order at start, against ZMQ's slow joiner (a PUB socket drops what it sends
before a new subscription reaches it): subscribe and connect first, wait (bounded) for the
connection's handshake and a moment for the subscription to travel, and only then fetch the
snapshot. Every batch published after the snapshot then arrives; one lost in the remaining
window shows as a gap at the next batch.

Sequence rules, with `last_seq` the last batch applied or the snapshot's seq:
- right after a resync, batches with seq <= last_seq were queued before the snapshot, which
  already includes them: skipped (while their seqs increase; a repeat means a restart);
- otherwise the next batch must be last_seq + 1; anything else (a gap: the replica's queue,
  ZMQ's high-water mark or the network dropped some; or a restarted replica counting from 1
  again) is counted in `num_gaps` and answered by a resync;
- a dropped connection resyncs once it is back (the replica may have restarted meanwhile).
A replica whose socket is a CURVE server (its `GET /v1/kv/events` names a `curve_public_key`)
is subscribed to with CURVE, under the router's own key pair (`curve_secret_key_file`, a key
the replica lists; `kvpool.formats.kv_events_curve`).
A resync that fails (the replica is down, a refused key) is retried with a backoff of up to
`MAX_BACKOFF_SECONDS`; the thread never dies of it, and `stop` returns within a poll.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import zmq
from zmq.utils.monitor import recv_monitor_message

from kvpool.formats.kv_events import EventSnapshot, decode_message
from kvpool.formats.kv_events_curve import make_curve_client
from kvpool.router.prefix_index import PrefixIndex

__all__ = ["EventSnapshot", "EventSource", "KVEventSubscriber", "SubscriberStats",
           "fetch_event_snapshot", "fetch_event_source"]

logger = logging.getLogger(__name__)

POLL_MS = 100  # how often the thread looks at `stop`
CONNECT_WAIT_SECONDS = 2.0  # the longest wait for the first handshake before a snapshot
SUBSCRIPTION_SETTLE_SECONDS = 0.05  # after the handshake, for the subscription to arrive
INITIAL_BACKOFF_SECONDS = 0.1
MAX_BACKOFF_SECONDS = 2.0
RCVHWM = 100_000  # messages buffered while a snapshot is fetched
_ANY_HOST = frozenset({"*", "0.0.0.0", "::", "[::]"})


@dataclass(frozen=True, slots=True)
class EventSource:
    """Where a replica publishes: a ZMQ endpoint to connect to, its topic and block size,
    and the socket's CURVE public key when it requires CURVE."""

    endpoint: str
    topic: str
    block_size: int
    curve_public_key: str | None = None


@dataclass(frozen=True, slots=True)
class SubscriberStats:
    num_batches: int  # applied
    num_events: int  # applied
    num_gaps: int  # batches out of sequence (each answered by a resync)
    num_resyncs: int  # snapshots applied
    last_seq: int
    is_synced: bool  # the index follows the replica (no gap or lost connection pending)


def fetch_event_source(base_url: str, headers: dict[str, str] | None = None,
                       timeout: float = 10.0) -> EventSource | None:
    """The replica's event source, or None when it publishes none (events off, the null
    publisher, or a server without the route). A "*" or "0.0.0.0" host in its endpoint (it
    bound every interface) becomes `base_url`'s host. httpx errors propagate."""
    response = httpx.get(f"{base_url.rstrip('/')}/v1/kv/events", headers=headers,
                         timeout=timeout)
    if response.status_code == 404:
        return None
    response.raise_for_status()
    doc = response.json()
    if not doc.get("enabled") or doc.get("publisher") != "zmq" or not doc.get("endpoint"):
        return None
    return EventSource(_reachable(doc["endpoint"], base_url), doc.get("topic") or "",
                       int(doc["block_size"]), doc.get("curve_public_key") or None)


def fetch_event_snapshot(base_url: str, headers: dict[str, str] | None = None,
                         timeout: float = 10.0) -> EventSnapshot:
    """Every (hash, medium) the replica holds and the seq of the last batch that includes;
    httpx errors propagate (HTTPStatusError for a refusal)."""
    response = httpx.get(f"{base_url.rstrip('/')}/v1/kv/events/snapshot", headers=headers,
                         timeout=timeout)
    response.raise_for_status()
    doc = response.json()
    blocks = [(bytes.fromhex(block["hash"]), block["medium"]) for block in doc["blocks"]]
    return EventSnapshot(int(doc["seq"]), blocks)


def _reachable(endpoint: str, base_url: str) -> str:
    scheme, _, address = endpoint.partition("://")
    host, _, port = address.rpartition(":")
    if host in _ANY_HOST:
        host = httpx.URL(base_url).host
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6, as ZMQ writes it
    return f"{scheme}://{host}:{port}"


class KVEventSubscriber:
    """Keeps `index` equal to what a replica holds, from its events (module docstring)."""

    def __init__(self, source: EventSource, index: PrefixIndex,
                 fetch_snapshot: Callable[[], EventSnapshot], name: str = "",
                 curve_secret_key_file: str | None = None) -> None:
        """ValueError when the replica requires CURVE and no key file is given."""
        if source.curve_public_key is not None and curve_secret_key_file is None:
            raise ValueError("the replica's KV event socket requires CURVE: give the router "
                             "a key pair the replica lists (--kv-events-curve-secret-key-file)")
        self.source = source
        self._curve_secret_key_file = curve_secret_key_file
        self.index = index
        self.name = name or source.endpoint
        self._fetch_snapshot = fetch_snapshot
        self._topic = source.topic.encode("utf-8")
        self._stopping = threading.Event()
        self._synced = threading.Event()
        self._lock = threading.Lock()  # the counters, read by `stats` on other threads
        self._num_batches = self._num_events = self._num_gaps = self._num_resyncs = 0
        self._last_seq = 0
        self._is_skipping_stale = False  # right after a resync (module docstring)
        self._last_skipped_seq = 0
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (again, after a `stop`); it resyncs before applying anything."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"the subscriber to {self.name} is already running")
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"kvpool-kv-events-sub {self.name}")
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread and close its socket (returns within a poll, unless a snapshot
        fetch is in flight: then within that fetch's timeout)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._synced.clear()

    def wait_synced(self, timeout: float) -> bool:
        """Block until the index follows the replica (a resync done, no gap since)."""
        return self._synced.wait(timeout)

    def stats(self) -> SubscriberStats:
        with self._lock:
            return SubscriberStats(self._num_batches, self._num_events, self._num_gaps,
                                   self._num_resyncs, self._last_seq, self._synced.is_set())

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        socket = zmq.Context.instance().socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RCVHWM, RCVHWM)
        socket.setsockopt(zmq.IPV6, int("[" in self.source.endpoint))
        socket.setsockopt(zmq.SUBSCRIBE, self._topic)
        if self.source.curve_public_key is not None:
            make_curve_client(socket, self._curve_secret_key_file, self.source.curve_public_key)
        monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED
                                            | zmq.EVENT_DISCONNECTED)
        try:
            socket.connect(self.source.endpoint)
            if monitor.poll(int(CONNECT_WAIT_SECONDS * 1000)):
                recv_monitor_message(monitor)
                self._stopping.wait(SUBSCRIPTION_SETTLE_SECONDS)
            self._follow(socket, monitor)
        except Exception:
            logger.exception("the KV event subscriber to %s failed", self.name)
        finally:
            self._synced.clear()
            socket.disable_monitor()
            monitor.close(linger=0)
            socket.close(linger=0)

    def _follow(self, socket: zmq.Socket, monitor: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        needs_resync, backoff = True, INITIAL_BACKOFF_SECONDS
        while not self._stopping.is_set():
            if needs_resync:
                if not self._resync():
                    self._stopping.wait(backoff)
                    backoff = min(2 * backoff, MAX_BACKOFF_SECONDS)
                    continue
                needs_resync, backoff = False, INITIAL_BACKOFF_SECONDS
            ready = dict(poller.poll(POLL_MS))
            if monitor in ready and self._connection_changed(monitor):
                needs_resync = True
            if socket in ready:
                needs_resync = self._receive(socket.recv_multipart()) or needs_resync

    def _connection_changed(self, monitor: zmq.Socket) -> bool:
        """A lost connection stops the index following; a new one asks for a resync."""
        event = recv_monitor_message(monitor)["event"]
        if event == zmq.EVENT_DISCONNECTED:
            self._synced.clear()
            return False
        return True

    def _receive(self, frames: list[bytes]) -> bool:
        """Apply one message; True when it shows the index must resync."""
        if frames and frames[0] != self._topic:
            return False  # another topic under the subscribed prefix
        try:
            seq, batch = decode_message(frames)
        except ValueError:
            logger.warning("undecodable KV event message from %s: resyncing", self.name)
            return self._gap()
        if self._is_skipping_stale and self._last_skipped_seq < seq <= self._last_seq:
            self._last_skipped_seq = seq  # queued before the snapshot, which includes it
            return False
        if seq != self._last_seq + 1:
            return self._gap()
        self.index.apply(batch)
        with self._lock:
            self._num_batches += 1
            self._num_events += len(batch.events)
            self._last_seq = seq
        self._is_skipping_stale = False
        return False

    def _gap(self) -> bool:
        with self._lock:
            self._num_gaps += 1
        self._synced.clear()
        return True

    def _resync(self) -> bool:
        """Replace the index with the replica's snapshot; False if it could not be had."""
        try:
            snapshot = self._fetch_snapshot()
        except Exception as error:
            logger.warning("KV event snapshot from %s failed (%s: %s); retrying", self.name,
                           type(error).__name__, error)
            return False
        if self._stopping.is_set():  # stopped meanwhile: the owner may have cleared the index
            return False
        self.index.replace(snapshot.blocks)
        with self._lock:
            self._last_seq = snapshot.seq
            self._num_resyncs += 1
        self._is_skipping_stale, self._last_skipped_seq = True, 0
        self._synced.set()
        return True

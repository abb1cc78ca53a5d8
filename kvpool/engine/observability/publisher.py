"""Where an engine's KV event batches go: a ZMQ PUB socket, or nowhere ("null").

    engine thread                          publisher thread (owns the PUB socket)
    KVEventLog.drain ── publish(seq, batch) ──▶ bounded queue ──▶ encode, send_multipart

The engine thread only enqueues (one lock, per non-empty step); encoding and sending happen on
`ZmqEventPublisher`'s daemon thread, which creates, binds and closes the socket, so no other
thread ever touches it. Past `max_queue_size` waiting batches the oldest is dropped and
counted; past `hwm` messages queued for a slow subscriber ZMQ drops for that subscriber alone.
Either way the consumer sees a gap in `seq` and resyncs from the snapshot endpoint.

`start_kv_events` is the engine's one call: the log, its publisher, the device pool and the
host tier's pool attached, closed at `LLMEngine.close` (or when the engine is collected).

With `curve_secret_key_file` the socket is a CURVE server and a ZAP handler on the thread's own
context admits only `curve_client_keys` (`kvpool.formats.kv_events_curve`); both are set up
before the bind, so no subscriber ever connects unauthenticated.

Invariants: num_batches_published + num_batches_dropped + batches still queued == batches
handed to `publish`; after `close` returns the socket is closed and `publish` only counts drops.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING

import zmq

from kvpool.engine.observability.event_log import EventPublisher, KVEventLog, PublisherStats
from kvpool.engine.observability.events_config import KVEventsConfig
from kvpool.formats.kv_events import KVEventBatch, encode_message
from kvpool.formats.kv_events_curve import make_curve_server, start_authenticator

__all__ = ["EventPublisher", "NullEventPublisher", "PublisherStats", "ZmqEventPublisher",
           "make_publisher", "start_kv_events"]

if TYPE_CHECKING:
    from kvpool.memory.kv_memory import KVMemory

logger = logging.getLogger(__name__)

BIND_TIMEOUT_SECONDS = 10.0
CLOSE_LINGER_MS = 500  # how long close() lets the socket flush what it sent


class NullEventPublisher:
    """`publisher="null"`: batches are numbered and counted, and go nowhere."""

    name = "null"
    endpoint = None
    curve_public_key = None

    def __init__(self) -> None:
        self._num_batches = 0
        self._num_events = 0

    def publish(self, seq: int, batch: KVEventBatch) -> None:
        self._num_batches += 1
        self._num_events += len(batch.events)

    def stats(self) -> PublisherStats:
        return PublisherStats(self._num_batches, self._num_events, 0)

    def close(self) -> None:
        return None


class ZmqEventPublisher:
    """A PUB socket bound at `config.endpoint` (a port of `*`: any free port; `endpoint`
    says which), fed by a bounded queue; ValueError if it cannot bind."""

    name = "zmq"

    def __init__(self, config: KVEventsConfig) -> None:
        self.topic = config.topic
        self.endpoint: str | None = None
        self.curve_public_key: str | None = None  # Z85, when the socket is a CURVE server
        self._max_queue_size = config.max_queue_size
        self._queue: deque[tuple[int, KVEventBatch]] = deque()
        self._ready = threading.Condition()
        self._is_closing = False
        self._num_batches = self._num_events = self._num_dropped = 0
        self._bind_error: str | None = None
        bound = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(config, bound), daemon=True,
                                        name="kvpool-kv-events")
        self._thread.start()
        if not bound.wait(BIND_TIMEOUT_SECONDS) or self._bind_error is not None:
            self.close()
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint!r}: "
                             f"{self._bind_error or 'timed out'}")

    def publish(self, seq: int, batch: KVEventBatch) -> None:
        """Queue a batch (the engine thread; never blocks on the network)."""
        with self._ready:
            if self._is_closing:
                self._num_dropped += 1
                return
            if len(self._queue) >= self._max_queue_size:
                self._queue.popleft()
                self._num_dropped += 1
            self._queue.append((seq, batch))
            self._ready.notify()

    def stats(self) -> PublisherStats:
        with self._ready:
            return PublisherStats(self._num_batches, self._num_events, self._num_dropped)

    def close(self) -> None:
        """Send what is queued, then close the socket (lingering briefly); idempotent."""
        with self._ready:
            self._is_closing = True
            self._ready.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(BIND_TIMEOUT_SECONDS)

    # ------------------------------------------------------------ publisher thread
    def _run(self, config: KVEventsConfig, bound: threading.Event) -> None:
        context = zmq.Context()
        socket = context.socket(zmq.PUB)
        authenticators = []
        try:
            socket.setsockopt(zmq.SNDHWM, config.hwm)
            if config.curve_secret_key_file is not None:
                authenticators.append(start_authenticator(context, config.curve_client_keys))
                public_key = make_curve_server(socket, config.curve_secret_key_file)
                self.curve_public_key = public_key.decode("ascii")
            socket.bind(config.endpoint)
            self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except (zmq.ZMQError, ValueError) as error:
            self._bind_error = str(error)
            _close(context, socket, authenticators, linger=0)
            return
        finally:
            bound.set()
        try:
            self._send_until_closed(socket)
        finally:
            _close(context, socket, authenticators, linger=CLOSE_LINGER_MS)

    def _send_until_closed(self, socket: zmq.Socket) -> None:
        while True:
            with self._ready:
                while not self._queue and not self._is_closing:
                    self._ready.wait()
                pending = list(self._queue)
                self._queue.clear()
                is_closing = self._is_closing
            for seq, batch in pending:
                socket.send_multipart(encode_message(self.topic, seq, batch), copy=False)
            with self._ready:
                self._num_batches += len(pending)
                self._num_events += sum(len(batch.events) for _, batch in pending)
            if is_closing:
                return


def _close(context: zmq.Context, socket: zmq.Socket, authenticators: list,
           linger: int) -> None:
    socket.close(linger=linger)
    for authenticator in authenticators:
        authenticator.stop()
    context.term()


def make_publisher(config: KVEventsConfig) -> EventPublisher:
    return ZmqEventPublisher(config) if config.publisher == "zmq" else NullEventPublisher()


def start_kv_events(config: KVEventsConfig | None, kv_memory: KVMemory,
                    owner: object) -> KVEventLog | None:
    """The engine's KV event log, hearing its device pool and host tier, publishing as
    `config` says; None when events are off (no socket, nothing attached). Closed when
    `owner` (the engine) is collected, if not before."""
    if config is None or not config.is_enabled:
        return None
    log = KVEventLog(config, kv_memory.layout.block_size, make_publisher(config))
    for pool, group in kv_memory.cache_pools():
        log.attach(pool, group)
    weakref.finalize(owner, log.publisher.close)
    logger.info("KV events: publishing to %s, topic %r", log.publisher.endpoint or "nowhere",
                config.topic)
    return log

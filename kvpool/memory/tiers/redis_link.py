"""The shared tier's connection to Redis, and whether Redis is up.

Every call times out after `timeout` seconds (connect and read alike) and is never retried, so
one failure costs the engine thread at most `timeout`. The first failure (`failed`) logs one
warning, counts an error and marks the link down; calls that fail while it is down are only
counted. While down, the shared tier makes no call on the engine thread; its writer thread
`probe`s (PING) every interval, and the first answer brings the link up again ("reconnected",
counted, `on_reconnect` run). When up, the same probe is a health check, so an idle replica
notices an outage too. On the first answer (at start or later), `maxmemory` and
`maxmemory-policy` are read once: a warning when the capacity is unbounded or not LRU; a
refused CONFIG (managed Redis) is ignored.

A Redis that restarted between two calls is no outage here: the client reconnects on its own
(a socket the server closed is replaced when next taken from the pool). So every new
connection reads the server's `run_id` (INFO server) after its handshake; a `run_id` other than
the last one seen means another Redis process answers now, maybe empty, and `on_reconnect`
runs as after an outage (the memo of what Redis holds is cleared, so lost blocks are written
again). A refused INFO (managed Redis) leaves only outages to tell.

Invariants: `num_errors`, `num_reconnects` and `num_restarts` only grow; `num_reconnects`
never exceeds the outages (one warning each) seen so far.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from kvpool.optional import require

if TYPE_CHECKING:
    import redis

logger = logging.getLogger(__name__)

def redis_module() -> ModuleType:
    """redis-py, imported when the shared tier is first used (an optional dependency)."""
    return require("redis", "the shared KV tier (--kv-shared-redis)")


def redis_errors() -> tuple[type[BaseException], ...]:
    """What a Redis call may raise for Redis trouble (an `except` clause's tuple)."""
    return (redis_module().RedisError, OSError)


class RedisLink:
    """A Redis client with a timeout, and the up/down state of the Redis behind it."""

    def __init__(self, url: str, timeout: float, on_reconnect: Callable[[], None]) -> None:
        """Connects lazily: call `probe` to learn whether Redis answers. `on_reconnect` runs
        when Redis answers again after an outage or a restart (module docstring)."""
        self.url = redacted(url)
        self.timeout = timeout
        redis = redis_module()
        self.client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout,
            retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0), health_check_interval=0,
            redis_connect_func=self._on_connect)
        self._on_reconnect = on_reconnect
        self._lock = threading.Lock()
        self._is_up = True
        self._is_config_checked = False
        self._run_id: str | None = None  # the server's, as of the last connection
        self.num_errors = 0
        self.num_reconnects = 0
        self.num_outages = 0
        self.num_restarts = 0  # new run_ids seen on a connection

    @property
    def is_up(self) -> bool:
        return self._is_up  # one attribute read: atomic

    def failed(self, error: BaseException) -> None:
        """A call failed: counted; the link goes down (one warning per outage)."""
        with self._lock:  # the warning is out before anyone can see the link down
            self.num_errors += 1
            if not self._is_up:
                return
            logger.warning("shared KV tier is down: Redis at %s failed (%s: %s); serving without "
                           "it until it answers again", self.url, type(error).__name__, error)
            self._is_up = False
            self.num_outages += 1

    def count_errors(self, num_errors: int) -> None:
        """Calls Redis answered with an error (out of memory...): no outage."""
        with self._lock:
            self.num_errors += num_errors

    def probe(self) -> None:
        """PING: up → down is an outage; down → up a reconnection."""
        was_up = self._is_up
        if not was_up:  # no socket from before the outage may serve the next call
            self.client.connection_pool.disconnect(inuse_connections=False)
        try:
            self.client.ping()
            if not self._is_config_checked:
                self._check_config()
        except redis_errors() as error:
            if was_up:
                self.failed(error)
            return
        if was_up:
            return
        self._on_reconnect()  # before calls resume: the memo may describe a Redis now gone
        with self._lock:
            logger.warning("shared KV tier reconnected to Redis at %s", self.url)
            self.num_reconnects += 1
            self._is_up = True

    def close(self) -> None:
        self.client.close()

    def _on_connect(self, connection: redis.connection.AbstractConnection) -> None:
        """A new connection: the client's own handshake, then the server's run_id checked
        (called by the client, on whichever thread makes the call that connects)."""
        connection.on_connect()
        run_id = _server_run_id(connection)
        with self._lock:
            is_restart = None not in (run_id, self._run_id) and run_id != self._run_id
            self._run_id = run_id or self._run_id
            self.num_restarts += is_restart
        if is_restart:
            logger.warning("shared KV tier: Redis at %s restarted (new run_id); forgetting what "
                           "it held", self.url)
            self._on_reconnect()

    def _check_config(self) -> None:
        try:
            maxmemory = self.client.config_get("maxmemory").get("maxmemory")
            policy = self.client.config_get("maxmemory-policy").get("maxmemory-policy")
        except redis_module().ResponseError:  # CONFIG refused: the operator sets the capacity
            self._is_config_checked = True
            return
        self._is_config_checked = True
        if str(maxmemory) == "0":
            logger.warning("Redis at %s has maxmemory 0 (no limit): the shared KV tier grows "
                           "until Redis runs out of memory; set maxmemory", self.url)
        if policy != "allkeys-lru":
            logger.warning("Redis at %s evicts by maxmemory-policy %r: the shared KV tier "
                           "expects allkeys-lru", self.url, policy)


def _server_run_id(connection: redis.connection.AbstractConnection) -> str | None:
    """The server's `run_id` (a new one at every start), or None if INFO is refused."""
    connection.send_command("INFO", "server")
    try:
        info = connection.read_response()
    except redis_module().ResponseError:
        return None
    text = info.decode() if isinstance(info, bytes) else str(info)
    for line in text.splitlines():
        if line.startswith("run_id:"):
            return line.partition(":")[2].strip()
    return None


def redacted(url: str) -> str:
    """The URL without its credentials or query (for logs)."""
    parts = urlsplit(url)
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc, query=""))

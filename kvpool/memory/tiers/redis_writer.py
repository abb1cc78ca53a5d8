"""The shared tier's writer: ONE daemon thread that encodes blocks and SETs them in Redis.

`submit` queues a write (a host snapshot of a block, read once `ready`) and returns at once; a
write that would take the queued bytes past `max_pending_bytes` is refused (the tier counts it
dropped). The thread takes up to `_MAX_BATCH` queued items at a time, encodes the writes
(`encode_block`) and sends them, with any queued deletes, in one pipeline. A batch while Redis
is down is dropped unsent; one that fails takes the link down (`RedisLink.failed`) and is
dropped too; a command Redis refuses (out of memory...) is an error, not an outage. When the
queue is idle for `probe_interval` seconds, the thread probes Redis (`RedisLink.probe`).

Keys are content-addressed (the salted chained hash names the tokens, hence the KV), so a write
is a SET NX: a value already there is kept, never overwritten, and the block is reported
present (`on_present`), neither stored nor dropped. So a bad write cannot replace a good value
(only a value that fails validation is deleted, by the tier, and so can be written again).

A written block is reported (`on_stored`, `on_present`) before it stops being pending, so that
at no moment is it neither: the tier never queues it twice.

Invariants (`check_invariants`): the queued bytes are those of the pending writes, never over
`max_pending_bytes`, and nothing is pending after `flush`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.tiers.disk_block_format import encode_block
from kvpool.memory.tiers.disk_tier import ReadyEvent
from kvpool.memory.tiers.redis_link import RedisLink, redis_module

logger = logging.getLogger(__name__)

_MAX_BATCH = 16  # commands per pipeline
_UNSENT = object()  # the reply of a command never sent (Redis down, or the pipeline failed)


@dataclass(slots=True)
class BlockWrite:
    key: str
    namespace: str
    block_hash: BlockHash
    token_ids: list[int]
    kv: torch.Tensor
    scales: torch.Tensor | None
    ready: ReadyEvent | None
    num_bytes: int  # K/V codes plus scales: what counts against `max_pending_bytes`


@dataclass(frozen=True, slots=True)
class _Delete:
    key: str


class RedisWriter:
    """The write queue and the thread that empties it into Redis."""

    def __init__(self, link: RedisLink, max_pending_bytes: int, probe_interval: float,
                 on_stored: Callable[[BlockHash, int], None],
                 on_present: Callable[[BlockHash], None]) -> None:
        """`on_stored(hash, value bytes)`: a block was written to Redis; `on_present(hash)`:
        Redis already held a value for it (kept: SET NX)."""
        self.link = link
        self.max_pending_bytes = max_pending_bytes
        self.probe_interval = probe_interval
        self._on_stored = on_stored
        self._on_present = on_present
        self._lock = threading.Lock()  # guards the four below
        self._drained = threading.Condition(self._lock)  # notified as the queue empties
        self._pending: dict[BlockHash, int] = {}  # queued or being written → tensor bytes
        self._num_queued = 0  # writes and deletes not yet done
        self._num_dropped = 0  # queued writes that never reached Redis
        self._queue: queue.SimpleQueue[BlockWrite | _Delete | None] = queue.SimpleQueue()
        self._is_stopping = False
        self._thread = threading.Thread(target=self._run, name="kvpool-redis-writer",
                                        daemon=True)
        self._thread.start()

    @property
    def num_pending_bytes(self) -> int:
        with self._lock:
            return sum(self._pending.values())

    @property
    def num_dropped(self) -> int:
        return self._num_dropped

    def is_pending(self, block_hash: BlockHash) -> bool:
        with self._lock:
            return block_hash in self._pending

    def submit(self, write: BlockWrite) -> bool:
        """Queue a write; False (nothing queued) if it is pending already or over the bound."""
        with self._lock:
            if write.block_hash in self._pending or self._is_stopping or (
                    sum(self._pending.values()) + write.num_bytes > self.max_pending_bytes):
                return False
            self._pending[write.block_hash] = write.num_bytes
            self._num_queued += 1
        self._queue.put(write)
        return True

    def delete(self, key: str) -> None:
        with self._lock:
            if self._is_stopping:
                return
            self._num_queued += 1
        self._queue.put(_Delete(key))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is done (or dropped); False on timeout."""
        with self._drained:
            return self._drained.wait_for(lambda: self._num_queued == 0, timeout)

    def close(self, timeout: float) -> None:
        """Flush (at most `timeout`), refuse more, stop the thread."""
        self.flush(timeout)
        with self._lock:
            self._is_stopping = True
        self._queue.put(None)
        self._thread.join(timeout)

    def check_invariants(self) -> None:
        with self._lock:
            assert self._num_queued == 0 and not self._pending, "writes still queued"
            assert self._num_dropped >= 0

    # ------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.probe_interval)
            except queue.Empty:
                if not self._is_stopping:
                    self.link.probe()
                continue
            batch = [item]
            while batch[-1] is not None and len(batch) < _MAX_BATCH:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            is_stop = batch[-1] is None
            self._write(batch[:-1] if is_stop else batch)
            if is_stop:
                return

    def _write(self, batch: list[BlockWrite | _Delete]) -> None:
        """One pipeline of SET NXs and DELs; if Redis fails, the batch is dropped (counted)."""
        replies: list[object] = [_UNSENT] * len(batch)
        sizes: list[int] = [0] * len(batch)
        try:
            if batch and self.link.is_up:
                pipe = self.link.client.pipeline(transaction=False)
                for index, item in enumerate(batch):
                    if isinstance(item, _Delete):
                        pipe.delete(item.key)
                        continue
                    if item.ready is not None:
                        item.ready.synchronize()
                    value = encode_block(item.namespace, item.block_hash, item.token_ids,
                                         item.kv, item.scales)
                    sizes[index] = len(value)
                    pipe.set(item.key, value, nx=True)  # True: written; None: kept
                replies = pipe.execute(raise_on_error=False)
        except Exception as error:  # down or slow, or a failed `ready`: the batch is lost
            self.link.failed(error)
        finally:
            self._done(batch, replies, sizes)

    def _done(self, batch: list[BlockWrite | _Delete], replies: list[object],
              sizes: list[int]) -> None:
        """Report what landed, release the batch, wake `flush`."""
        refused = [reply for reply in replies if isinstance(reply, redis_module().ResponseError)]
        if refused:
            logger.debug("shared KV tier: Redis refused %d commands: %r", len(refused),
                         refused[0])
            self.link.count_errors(len(refused))
        for item, reply, size in zip(batch, replies, sizes, strict=True):
            if isinstance(item, BlockWrite) and reply is True:
                self._on_stored(item.block_hash, size)
            elif isinstance(item, BlockWrite) and reply is None:
                self._on_present(item.block_hash)
        with self._drained:
            for item, reply in zip(batch, replies, strict=True):
                if isinstance(item, BlockWrite):
                    del self._pending[item.block_hash]
                    self._num_dropped += reply is not True and reply is not None
            self._num_queued -= len(batch)
            self._drained.notify_all()

"""The shared KV tier: full prefix blocks in Redis, found by every replica naming the same Redis.

    key    kvpool:kv:<namespace_dir_name(namespace)>:<block hash hex>
    value  encode_block(namespace, block hash, token ids, kv, scales)
           (`kvpool.memory.tiers.disk_block_format`: the disk tier's file format, one format)

The hash is the salted chain (`kvpool.memory.prefix_cache`), so a tenant's blocks are found only
under its salt; the namespace (model, weights, dtype, block size, KV dtype and shape:
`kvpool.engine.setup.kv_namespace`) is in the key, so another model's or layout's block never
matches, and inside the value, where `decode_block` checks it with the format version, the
hash, the tensors' shapes, a checksum and the token ids. A value that fails any check is
counted, deleted and never served. Capacity is Redis's own (`maxmemory` with `allkeys-lru`,
checked at connection: `kvpool.memory.tiers.redis_link`).

Round trips on the engine thread, per admission: `find` sizes the run with at most ONE
pipelined EXISTS, of the hashes the memo (`kvpool.memory.tiers.redis_memo`) does not answer; then,
once the plan is known to fit, `load_run` makes ONE MGET of just those keys. The memo keeps
hashes found absent for `miss_ttl` seconds, so a waiting sequence re-planned every step costs
no round trip, and a bounded set of hashes known to be in Redis, which `store` skips: a block
reloaded from Redis and published on the device is not written back.

Writes never wait on Redis: `store` queues a host snapshot of the block, and ONE daemon writer
thread (`kvpool.memory.tiers.redis_writer`) encodes and SETs, pipelined, only where no value is
(SET NX: a key names its content, so a value there is never overwritten). Queued bytes are bounded
(`max_pending_bytes`): a store past it is dropped and counted. The same thread deletes rejected
keys and, when idle, probes Redis every `probe_interval` seconds.

Redis down or slow (a call past `timeout` seconds fails; no retries): the first failure logs
one warning, counts an error and marks the tier down (`RedisLink`). While down the engine
thread never calls Redis: `find` finds nothing, `load_run` loads nothing, stores are dropped
and counted. The writer's probe brings it back ("reconnected", counted), with the memo
cleared: a restarted Redis may have lost everything. Nothing here raises for Redis trouble.

Invariants (`check_invariants`, after `flush`): the queued bytes never exceed
`max_pending_bytes`, and nothing is queued after `flush`; the memo's own; no counter is negative,
and reconnections never outnumber outages. Whatever `load_run` returns decoded to exactly the
block asked for (hash, tokens, namespace, layout, checksum).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.tiers.disk_block_format import StoredBlock, decode_block, namespace_dir_name
from kvpool.memory.tiers.disk_tier import ReadyEvent
from kvpool.memory.tiers.lower_tier import SHARED, BlockFinder, LowerTier, StoredRef
from kvpool.memory.tiers.redis_link import RedisLink, redis_errors
from kvpool.memory.tiers.redis_memo import PresenceMemo
from kvpool.memory.tiers.redis_writer import BlockWrite, RedisWriter

logger = logging.getLogger(__name__)

KEY_PREFIX = "kvpool:kv"
CLOSE_TIMEOUT_S = 10.0  # the longest `close` waits for queued writes


def shared_key(namespace: str, block_hash: BlockHash) -> str:
    """The Redis key of a block in a namespace."""
    return f"{KEY_PREFIX}:{namespace_dir_name(namespace)}:{block_hash.hex()}"


@dataclass(frozen=True, slots=True)
class SharedTierStats:
    is_up: bool  # False while Redis is unreachable (or too slow)
    num_pending_bytes: int  # queued for writing
    num_known_blocks: int  # hashes the memo knows to be in Redis
    num_errors: int  # Redis calls that failed (down, slow, refused)
    num_reconnects: int  # times Redis answered again after being down
    num_dropped_writes: int  # blocks not written: Redis down, or queued bytes over the bound
    num_stored_blocks: int  # values written by this process
    num_stored_bytes: int
    num_loaded_blocks: int  # validated values served
    num_loaded_bytes: int
    num_rejected_blocks: int  # truncated / corrupt / foreign / other tokens: deleted, not served
    num_lookups: int  # pipelined EXISTS round trips (engine thread)
    num_fetches: int  # MGET round trips (engine thread)


@dataclass(slots=True)
class _Counters:
    num_stored_blocks: int = 0
    num_stored_bytes: int = 0
    num_loaded_blocks: int = 0
    num_loaded_bytes: int = 0
    num_rejected_blocks: int = 0
    num_lookups: int = 0
    num_fetches: int = 0


class RedisKVTier(LowerTier):
    """Full KV blocks in Redis by salted hash, shared between replicas (module docstring)."""

    name = SHARED

    def __init__(self, url: str, layout: KVLayout, namespace: str, *, timeout: float = 0.5,
                 max_pending_bytes: int = 256 * 2**20, probe_interval: float = 1.0,
                 miss_ttl: float = 1.0, max_known: int = 2**16) -> None:
        """Connect (a Redis that does not answer starts the tier down, with a warning) and
        start the writer thread."""
        if not timeout > 0 or not probe_interval > 0 or max_pending_bytes < 0:
            raise ValueError(f"bad shared tier settings: timeout={timeout}, probe_interval="
                             f"{probe_interval}, max_pending_bytes={max_pending_bytes}")
        self.layout = layout
        self.namespace = namespace
        self._lock = threading.Lock()  # guards the memo and the counters
        self._memo = PresenceMemo(max_known, miss_ttl)
        self._counters = _Counters()
        self._num_dropped_writes = 0  # refused before queueing (the writer counts the rest)
        self._is_closed = False
        self.link = RedisLink(url, timeout, self._forget_everything)
        self.link.probe()
        self.writer = RedisWriter(self.link, max_pending_bytes, probe_interval, self._stored,
                                  self._present)

    # ------------------------------------------------------------ engine thread
    @property
    def is_up(self) -> bool:
        return self.link.is_up and not self._is_closed

    def start_lookup(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> BlockFinder:
        """Redis asked once per lookup (`find`), at the first block the nearer tiers lack,
        for it and every later block of the run."""
        first, found = 0, None

        def find(index: int, token_ids: Sequence[int]) -> StoredRef | None:
            nonlocal first, found
            if found is None:
                first, found = index, self.find(block_hashes[index:num_blocks])
            return StoredRef(SHARED, block_hashes[index]) if found[index - first] else None

        return find

    def summary(self) -> dict[str, int]:
        stats = self.stats()
        return {"is_up": int(stats.is_up), "num_stored_blocks": stats.num_stored_blocks,
                "num_loaded_blocks": stats.num_loaded_blocks}

    def find(self, block_hashes: Sequence[BlockHash]) -> list[bool]:
        """Whether each block is in Redis: from the memo, else ONE pipelined EXISTS of the
        rest; all False while Redis is down (no call). A True may be stale: `load_run` tells."""
        if not self.is_up:
            return [False] * len(block_hashes)
        now = time.monotonic()
        with self._lock:
            answers = [self._memo.lookup(block_hash, now) for block_hash in block_hashes]
        unknown = [index for index, answer in enumerate(answers) if answer is None]
        if not unknown:
            return answers
        pipe = self.link.client.pipeline(transaction=False)
        for index in unknown:
            pipe.exists(shared_key(self.namespace, block_hashes[index]))
        try:
            replies = pipe.execute()
        except redis_errors() as error:
            self.link.failed(error)
            return [False] * len(block_hashes)
        with self._lock:
            self._counters.num_lookups += 1
            for index, reply in zip(unknown, replies, strict=True):
                answers[index] = bool(reply)
                self._memo.remember(block_hashes[index], answers[index], now)
        return answers

    def load_run(self, block_hashes: Sequence[BlockHash],
                 token_ids: Sequence[Sequence[int]]) -> list[StoredBlock]:
        """The leading blocks Redis holds for exactly these tokens: ONE MGET, then each value
        validated in order up to the first missing or rejected one (counted, and deleted by
        the writer). Nothing while Redis is down; never raises for Redis trouble."""
        if not block_hashes or not self.is_up:
            return []
        keys = [shared_key(self.namespace, block_hash) for block_hash in block_hashes]
        try:
            values = self.link.client.mget(keys)
        except redis_errors() as error:
            self.link.failed(error)
            return []
        blocks, num_bytes = [], 0
        for block_hash, tokens, key, value in zip(block_hashes, token_ids, keys, values,
                                                  strict=True):
            if value is None:
                break
            try:
                blocks.append(decode_block(value, self.layout, self.namespace, block_hash,
                                           [int(token_id) for token_id in tokens]))
            except Exception as error:  # untrusted bytes: whatever fails, it is not served
                self._reject(key, error)
                break
            num_bytes += len(value)
        now = time.monotonic()
        with self._lock:
            self._counters.num_fetches += 1
            self._counters.num_loaded_blocks += len(blocks)
            self._counters.num_loaded_bytes += num_bytes
            for index, block_hash in enumerate(block_hashes[:len(blocks) + 1]):
                self._memo.remember(block_hash, index < len(blocks), now)
        return blocks

    def wanted(self, block_hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """Those of `block_hashes` a `store` would queue: neither known to be in Redis nor
        queued. None while Redis is down: those are counted as dropped writes here, so the
        caller need not copy their KV."""
        if self._is_closed:
            return set()
        with self._lock:
            new = {block_hash for block_hash in block_hashes
                   if not self._memo.is_known(block_hash)}
        new = {block_hash for block_hash in new if not self.writer.is_pending(block_hash)}
        if not self.link.is_up:
            with self._lock:
                self._num_dropped_writes += len(new)
            return set()
        return new

    def store(self, block_hash: BlockHash, token_ids: Sequence[int], kv: torch.Tensor,
              scales: torch.Tensor | None, ready: ReadyEvent | None = None) -> None:
        """Queue one full block for writing; returns at once. Same contract as
        `DiskKVTier.store`: the tier reads `kv` and `scales` (host buffers, after
        `ready.synchronize()`) until the write is done. A known or queued hash is skipped; a
        store while down, or past `max_pending_bytes`, is dropped and counted."""
        assert isinstance(block_hash, bytes) and len(block_hash) == 32, f"bad hash {block_hash!r}"
        self.layout.check_tensor(kv.unsqueeze(0))
        self.layout.check_scales(None if scales is None else scales.unsqueeze(0), 1)
        with self._lock:
            if self._is_closed or self._memo.is_known(block_hash):
                return
            self._memo.forget_missing(block_hash)  # this process's own write ends it
        if self.writer.is_pending(block_hash):
            return
        num_bytes = kv.nbytes + (0 if scales is None else scales.nbytes)
        write = BlockWrite(shared_key(self.namespace, block_hash), self.namespace, block_hash,
                           [int(token_id) for token_id in token_ids], kv, scales, ready,
                           num_bytes)
        if not self.link.is_up or not self.writer.submit(write):
            with self._lock:
                self._num_dropped_writes += 1

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write and delete is done (or dropped); False on timeout."""
        return self.writer.flush(timeout)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Flush (waiting at most `timeout`), then stop the writer; later calls find nothing
        and store nothing. Idempotent."""
        if self._is_closed:
            return
        self._is_closed = True
        self.writer.close(timeout)
        self.link.close()

    def stats(self) -> SharedTierStats:
        link, writer = self.link, self.writer
        with self._lock:
            return SharedTierStats(
                is_up=self.is_up, num_pending_bytes=writer.num_pending_bytes,
                num_known_blocks=len(self._memo), num_errors=link.num_errors,
                num_reconnects=link.num_reconnects,
                num_dropped_writes=self._num_dropped_writes + writer.num_dropped,
                **dataclasses.asdict(self._counters))

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (call after `flush`)."""
        self.writer.check_invariants()
        assert self.writer.num_pending_bytes <= self.writer.max_pending_bytes
        with self._lock:
            self._memo.check_invariants()
            counters = dataclasses.asdict(self._counters)
        assert all(value >= 0 for value in counters.values()), counters
        assert self.link.num_reconnects <= self.link.num_outages, "more comebacks than falls"

    # ------------------------------------------------------------ helpers
    def _stored(self, block_hash: BlockHash, num_bytes: int) -> None:
        """The writer's report: a block is in Redis."""
        with self._lock:
            self._counters.num_stored_blocks += 1
            self._counters.num_stored_bytes += num_bytes
            self._memo.remember(block_hash, True, time.monotonic())

    def _present(self, block_hash: BlockHash) -> None:
        """The writer's report: Redis already held the block (another replica wrote it)."""
        with self._lock:
            self._memo.remember(block_hash, True, time.monotonic())

    def _forget_everything(self) -> None:
        """Redis is back, maybe restarted empty: what the memo knows may be gone."""
        with self._lock:
            self._memo.clear()

    def _reject(self, key: str, error: Exception) -> None:
        """A value that failed validation: counted, and its key deleted by the writer."""
        logger.debug("shared KV tier: rejecting %s: %r", key, error)
        with self._lock:
            self._counters.num_rejected_blocks += 1
        self.writer.delete(key)

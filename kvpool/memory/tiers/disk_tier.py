"""The disk tier: full KV prefix blocks kept as files, under a byte budget, across restarts.

One file per block, by hash, in a directory per namespace (model and KV layout); the names,
the contents and the checks on them are `kvpool.memory.tiers.disk_block_format`. `load` serves
a file only if all of it matches the query and the layout; any other file (missing, truncated,
corrupt, foreign, other tokens) is deleted and counted as rejected: a miss, never an error.
Writes go to a temp file in the same directory, then `os.replace`, so readers see a whole file
or none; no fsync: a file torn by a power cut fails validation, which is only a miss.

`store` only queues; ONE daemon writer thread evicts least-recently-used files to stay within
`capacity_bytes`, then writes. A file's mtime is its recency (a write or a validated load sets
it from a strictly increasing clock), so a restart rebuilds the LRU order from the directory;
contents are validated lazily, on load.

The tier is a cache, so it never raises for I/O. The first failed write or delete (ENOSPC,
EIO, a read-only mount...) logs one warning and switches the tier off for the life of the
object: `store` is a no-op, `contains` False, `load` None, queued writes are dropped. Files
already written stay for the next process, which indexes them again. A directory that cannot be
created or scanned starts the tier off the same way; ValueError only if `directory` exists and
is not a directory. One process per namespace directory at a time (start-up deletes temp files).

Invariants (`check_invariants`, after `flush`):
- The index's file sizes sum to `num_bytes`, and `num_bytes <= capacity_bytes`.
- Once the start-up scan succeeded, the index mirrors the namespace directory: every indexed
  block's file exists with the indexed size, every block file is indexed, and no temp file is
  left, while the tier is open. Only a write in flight (`flush` ends those) or a failed delete
  (which switches the tier off and ends the mirror: the index no longer knows that file)
  breaks this.
- Nothing is pending after `flush`, so nothing is pending once the tier is off.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

import kvpool.memory.tiers.disk_block_format as block_format
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.prefix_cache import BlockHash
from kvpool.memory.tiers.disk_block_format import FORMAT_TAG, SUFFIX, TEMP_SUFFIX, StoredBlock
from kvpool.memory.tiers.lower_tier import DISK, BlockFinder, LowerTier, StoredRef

__all__ = ["FORMAT_TAG", "SUFFIX", "TEMP_SUFFIX", "DiskKVTier", "DiskTierStats", "ReadyEvent",
           "StoredBlock"]

logger = logging.getLogger(__name__)


class ReadyEvent(Protocol):
    """A `torch.cuda.Event` recorded after the copy that fills a stored block's tensors."""

    def synchronize(self) -> None: ...


@dataclass(frozen=True, slots=True)
class DiskTierStats:
    is_enabled: bool  # False after a write failure (disk full...) or if the dir is unusable
    capacity_bytes: int
    num_files: int
    num_bytes: int  # sum of indexed file sizes
    num_stored_blocks: int  # files written by this process
    num_stored_bytes: int
    num_loaded_blocks: int  # validated loads served
    num_loaded_bytes: int
    num_rejected_files: int  # truncated / corrupt / foreign / wrong tokens: deleted, never served
    num_evicted_files: int  # removed by the LRU to stay within capacity
    num_write_errors: int
    num_dropped_writes: int  # store() calls dropped: the pending queue was over its byte bound


@dataclass(slots=True)
class _Counters:
    num_stored_blocks: int = 0
    num_stored_bytes: int = 0
    num_loaded_blocks: int = 0
    num_loaded_bytes: int = 0
    num_rejected_files: int = 0
    num_evicted_files: int = 0
    num_write_errors: int = 0
    num_dropped_writes: int = 0


@dataclass(slots=True)
class _PendingWrite:
    block_hash: BlockHash
    token_ids: list[int]
    kv: torch.Tensor
    scales: torch.Tensor | None
    ready: ReadyEvent | None
    num_bytes: int  # K/V codes plus scales: what counts against `max_pending_bytes`


def _remove(path: str | Path) -> None:
    """Delete a file; one already gone is fine (OSError for anything else)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class DiskKVTier(LowerTier):
    """Full KV blocks on disk by hash: LRU within `capacity_bytes`, written in the background."""

    name = DISK

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int, layout: KVLayout,
                 namespace: str, *, max_pending_bytes: int = 256 * 2**20) -> None:
        """Index the namespace directory (creating it if needed) and start the writer."""
        if capacity_bytes < 0 or max_pending_bytes < 0:
            raise ValueError(f"capacity_bytes ({capacity_bytes}) and max_pending_bytes "
                             f"({max_pending_bytes}) must not be negative")
        root = Path(directory)
        if root.exists() and not root.is_dir():
            raise ValueError(f"the disk KV tier directory {root} exists and is not a directory")
        self.layout = layout
        self.namespace = namespace
        self.capacity_bytes = capacity_bytes
        self.max_pending_bytes = max_pending_bytes
        self.directory = root / block_format.namespace_dir_name(namespace)
        self._lock = threading.Lock()  # guards everything below; see the module docstring
        self._index: OrderedDict[BlockHash, int] = OrderedDict()  # hash → file size, LRU first
        self._num_bytes = 0
        self._pending: dict[BlockHash, int] = {}  # queued or being written → its tensor bytes
        self._num_pending_bytes = 0
        self._queue: queue.Queue[_PendingWrite | None] = queue.Queue()
        self._counters = _Counters()
        self._clock_ns = time.time_ns()
        self._is_enabled = True
        self._is_mirrored = False  # the index mirrors the directory (module docstring)
        self._is_closed = False
        self._writer: threading.Thread | None = None
        self._open()
        if self._is_enabled:
            self._writer = threading.Thread(target=self._write_loop, name="kvpool-disk-writer",
                                            daemon=True)
            self._writer.start()

    # ------------------------------------------------------------ the tier walk
    def start_lookup(self, block_hashes: Sequence[BlockHash], num_blocks: int) -> BlockFinder:
        """Each block found in the index (no I/O), as a reference `load_run` reads."""
        def find(index: int, token_ids: Sequence[int]) -> StoredRef | None:
            block_hash = block_hashes[index]
            return StoredRef(DISK, block_hash) if self.contains(block_hash) else None

        return find

    def holds(self, block_hash: BlockHash, token_ids: Sequence[int]) -> bool:
        return self.contains(block_hash)

    def load_run(self, block_hashes: Sequence[BlockHash],
                 token_ids: Sequence[Sequence[int]]) -> list[StoredBlock]:
        """The leading blocks `load` serves, one file at a time, up to the first it does not."""
        blocks = []
        for block_hash, tokens in zip(block_hashes, token_ids, strict=True):
            block = self.load(block_hash, tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def wanted(self, block_hashes: Sequence[BlockHash]) -> set[BlockHash]:
        """The hashes with no file yet (none while the tier is off)."""
        if not self.stats().is_enabled:
            return set()
        return {block_hash for block_hash in block_hashes if not self.contains(block_hash)}

    def summary(self) -> dict[str, int]:
        stats = self.stats()
        return {"num_blocks": stats.num_files, "num_bytes": stats.num_bytes}

    # ------------------------------------------------------------ public API
    def contains(self, block_hash: BlockHash) -> bool:
        """Whether a file for this hash is indexed (no I/O; a queued write is not yet)."""
        with self._lock:
            return self._is_enabled and block_hash in self._index

    def load(self, block_hash: BlockHash, token_ids: Sequence[int]) -> StoredBlock | None:
        """The block stored under this hash for exactly these tokens, or None. A file that fails
        validation is deleted and counted (`num_rejected_files`); this never raises."""
        tokens = [int(token_id) for token_id in token_ids]
        with self._lock:
            if not self._is_enabled or block_hash not in self._index:
                return None
        path = self._path(block_hash)
        try:
            data = path.read_bytes()
            block = block_format.decode_block(data, self.layout, self.namespace, block_hash, tokens)
        except Exception as error:  # untrusted bytes: whatever fails, the file is not served
            self._reject(block_hash, path, error)
            return None
        with self._lock:
            self._counters.num_loaded_blocks += 1
            self._counters.num_loaded_bytes += len(data)
            if block_hash in self._index:  # not evicted meanwhile
                self._index.move_to_end(block_hash)
                self._touch(path)
        return block

    def store(self, block_hash: BlockHash, token_ids: Sequence[int], kv: torch.Tensor,
              scales: torch.Tensor | None, ready: ReadyEvent | None = None) -> None:
        """Queue one full block for writing; returns at once and never raises for I/O.

        The tier keeps references to `kv` and `scales` (no copy) until the write is done: the
        caller hands them over and must not modify them again. They are meant to be host
        buffers (pinned, filled by an async device-to-host copy); if `ready` is given, the
        writer calls `ready.synchronize()` before reading them. A hash already indexed or
        queued is skipped; a store that would take the queued bytes past `max_pending_bytes`
        is dropped and counted. Tensors that do not fit the layout are a caller's bug
        (AssertionError).
        """
        assert isinstance(block_hash, bytes) and len(block_hash) == 32, f"bad hash {block_hash!r}"
        self.layout.check_tensor(kv.unsqueeze(0))
        self.layout.check_scales(None if scales is None else scales.unsqueeze(0), 1)
        num_bytes = kv.nbytes + (0 if scales is None else scales.nbytes)
        tokens = [int(token_id) for token_id in token_ids]
        with self._lock:
            if (not self._is_enabled or self._is_closed or block_hash in self._index
                    or block_hash in self._pending):
                return
            if self._num_pending_bytes + num_bytes > self.max_pending_bytes:
                self._counters.num_dropped_writes += 1
                return
            self._pending[block_hash] = num_bytes
            self._num_pending_bytes += num_bytes
            # Under the lock, so that `close` never queues its stop marker before this item.
            self._queue.put(_PendingWrite(block_hash, tokens, kv, scales, ready, num_bytes))

    def flush(self) -> None:
        """Block until every queued write is on disk (or dropped, if the tier went off)."""
        self._queue.join()

    def close(self) -> None:
        """Flush, then stop the writer thread; later stores are no-ops. Idempotent."""
        with self._lock:
            if self._is_closed:
                return
            self._is_closed = True
        self.flush()
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join()

    def stats(self) -> DiskTierStats:
        with self._lock:
            return DiskTierStats(
                is_enabled=self._is_enabled, capacity_bytes=self.capacity_bytes,
                num_files=len(self._index), num_bytes=self._num_bytes,
                **dataclasses.asdict(self._counters))

    def check_invariants(self) -> None:
        """Assert the module docstring's invariants (call after `flush`; scans the directory)."""
        with self._lock:
            assert not self._pending and self._num_pending_bytes == 0, "writes still pending"
            assert self._queue.unfinished_tasks == 0, "writes still queued"
            assert sum(self._index.values()) == self._num_bytes <= self.capacity_bytes, (
                f"index bytes {sum(self._index.values())}, num_bytes {self._num_bytes}, "
                f"capacity {self.capacity_bytes}")
            if not self._is_mirrored or self._is_closed:  # closed: the next process owns it
                return
            scan = block_format.scan_namespace_dir(self.directory)
            assert not scan.temp_paths, f"stray temp files {scan.temp_paths}"
            assert not scan.misnamed_paths, f"unindexed block files {scan.misnamed_paths}"
            on_disk = {block_hash.hex(): size for _, block_hash, size in scan.block_files}
            expected = {block_hash.hex(): size for block_hash, size in self._index.items()}
            assert on_disk == expected, f"disk {on_disk} != index {expected}"

    # ------------------------------------------------------------ start-up
    def _open(self) -> None:
        """Index the block files oldest first (by mtime), delete stray temp files and
        misnamed block files, and evict down to the capacity; any OSError starts the tier off."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            scan = block_format.scan_namespace_dir(self.directory)
            for path in scan.temp_paths + scan.misnamed_paths:  # no block of ours, or half one
                _remove(path)
            self._counters.num_rejected_files += len(scan.misnamed_paths)
            for mtime_ns, block_hash, size in scan.block_files:  # oldest first
                self._index[block_hash] = size
                self._num_bytes += size
                self._clock_ns = max(self._clock_ns, mtime_ns)
            self._is_mirrored = True
        except OSError as error:
            self._disable(f"cannot use the directory {self.directory}: {error!r}")
            return
        with self._lock:
            victims = self._evict_to(self.capacity_bytes)
        self._delete(victims)

    # ------------------------------------------------------------ writer thread
    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._write(item)
            finally:
                with self._lock:  # after the index holds it, so `store` sees no gap
                    del self._pending[item.block_hash]
                    self._num_pending_bytes -= item.num_bytes
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, item: _PendingWrite) -> None:
        """Make room by LRU, write a temp file, move it into place; any failure switches the
        tier off (the writer thread itself never dies)."""
        path = self._path(item.block_hash)
        temp = block_format.temp_path(path)
        try:
            with self._lock:
                if not self._is_enabled:
                    return
            if item.ready is not None:
                item.ready.synchronize()
            data = block_format.encode_block(self.namespace, item.block_hash, item.token_ids,
                                             item.kv, item.scales)
            if len(data) > self.capacity_bytes:
                return  # bigger than the whole budget: never stored
            with self._lock:
                victims = self._evict_to(self.capacity_bytes - len(data))
            if not self._delete(victims):
                return
            path.parent.mkdir(exist_ok=True)
            with open(temp, "wb") as file:
                file.write(data)
            with self._lock:
                os.replace(temp, path)
                self._touch(path)  # its mtime is its recency, set with the index's order
                self._index[item.block_hash] = len(data)
                self._num_bytes += len(data)
                self._counters.num_stored_blocks += 1
                self._counters.num_stored_bytes += len(data)
        except Exception as error:  # OSError (ENOSPC...), or a failed `ready`: the tier goes off
            with self._lock:
                self._counters.num_write_errors += 1
            with contextlib.suppress(OSError):
                _remove(temp)
            self._disable(f"cannot write {path}: {error!r}")

    # ------------------------------------------------------------ helpers
    def _path(self, block_hash: BlockHash) -> Path:
        return self.directory.joinpath(*block_format.block_file_parts(block_hash))

    def _evict_to(self, budget: int) -> list[Path]:
        """Drop least-recently-used entries until `num_bytes <= budget`; the files to delete
        (outside the lock). Caller holds the lock."""
        victims = []
        while self._num_bytes > budget:
            block_hash, size = self._index.popitem(last=False)
            self._num_bytes -= size
            self._counters.num_evicted_files += 1
            victims.append(self._path(block_hash))
        return victims

    def _touch(self, path: Path) -> None:
        """Set a file's mtime from a strictly increasing clock, so mtimes keep the exact LRU
        order even where the file system's clock is coarser than successive writes. Under the
        lock (a metadata-only call), so on-disk order always equals the index's order."""
        self._clock_ns = max(time.time_ns(), self._clock_ns + 1)
        with contextlib.suppress(OSError):  # evicted meanwhile; or only a restart's order is off
            os.utime(path, ns=(self._clock_ns, self._clock_ns))

    def _delete(self, paths: list[Path]) -> bool:
        """Delete files the index has let go of. True if all are gone; else the tier is off and
        the index no longer mirrors the directory."""
        for path in paths:
            try:
                _remove(path)
            except OSError as error:
                with self._lock:
                    self._is_mirrored = False
                self._disable(f"cannot delete {path}: {error!r}")
                return False
        return True

    def _reject(self, block_hash: BlockHash, path: Path, error: Exception) -> None:
        """Delete a file that failed validation (first, so a rewrite cannot race it), then drop
        it from the index and count it, unless the LRU evicted it meanwhile."""
        logger.debug("disk KV tier: rejecting %s: %r", path, error)
        self._delete([path])
        with self._lock:
            size = self._index.pop(block_hash, None)
            if size is not None:
                self._num_bytes -= size
                self._counters.num_rejected_files += 1

    def _disable(self, reason: str) -> None:
        """Switch the tier off for good, with one warning."""
        with self._lock:
            was_enabled, self._is_enabled = self._is_enabled, False
        if was_enabled:
            logger.warning("disk KV tier is off from now on: %s", reason)

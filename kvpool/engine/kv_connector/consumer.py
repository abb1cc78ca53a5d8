"""The consumer's half of a handover: load a prompt's blocks from the producer that computed
them, into this engine's prefix cache, then let the request in.

A `do_remote_prefill` request does not go to the scheduler at once. `start` looks its handed-
over blocks up in the local prefix cache first (a repeat loads nothing), takes new blocks for
the rest in a holding table, and loads them on a worker thread:

    link.check(lease, pairs)        the producer still holds them (a dead one fails fast here)
    link.read((local, remote) ...)  the bytes, through the transfer engine
    link.checksums(lease, pairs)    taken under the live lease, after the read: so the bytes
                                    read were the leased ones (`producer`), and they match
    link.release(lease)             the producer may free them

`collect` (the step thread) publishes a loaded table's blocks to the prefix cache under the
request's block hashes and hands the request to the scheduler, whose admission takes them as
a prefix hit and computes the prompt's rest (at least its last token, for its logits). The
holding table keeps its references until the request finishes (`finish`), so nothing evicts
the loaded blocks before the request is admitted. A load that fails follows the policy:
"recompute" (the blocks go back unpublished; the request computes its prompt itself) or
"fail" (the request ends with the error). A load past `timeout_seconds` is given up the same
way, but its destination blocks stay held until the transfer engine has no transfer running
(`is_quiet`): a late write must never land in a block someone else was given.

Invariants: a request is loading, held, or unknown here; a destination block is published only
after its checksum matched under a live lease; no block of a load that may still be written is
returned to the pool.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvpool.engine.kv_connector.checksums import verify_blocks
from kvpool.engine.kv_connector.errors import (
    FailureReason,
    IncompatibleKVError,
    KVTransferError,
)
from kvpool.engine.kv_connector.params import RemotePrefill, token_digest
from kvpool.engine.kv_connector.stats import LatencyHistogram
from kvpool.engine.sequence import Request
from kvpool.memory.block_table import BlockTable
from kvpool.memory.kv_memory import KVMemory

logger = logging.getLogger(__name__)

MAX_CONCURRENT_LOADS = 4


class PeerLink(Protocol):
    """A consumer's channel to one producer (Mooncake + side channel, or in-process)."""

    def check(self, lease_id: str, prompt_digest: str,
              pairs: Sequence[tuple[int, int]]) -> None: ...

    def read(self, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy remote blocks into local ones: pairs are (local id, remote id)."""
        ...

    def checksums(self, lease_id: str, prompt_digest: str,
                  pairs: Sequence[tuple[int, int]]) -> list[int]: ...

    def release(self, lease_id: str) -> None: ...


LinkFactory = Callable[[RemotePrefill], PeerLink]  # handshakes; IncompatibleKVError, ...


@dataclass(eq=False)
class _Load:
    request: Request
    block_hashes: list
    remote: RemotePrefill
    table: BlockTable  # local hits, then the destination blocks
    pairs: list[tuple[int, int]]  # (local id, remote id) of the blocks read
    started: float
    future: Future | None = None
    aborted: bool = False


@dataclass(frozen=True, slots=True)
class Loaded:
    """A request whose load ended: its blocks loaded (no error), or not (the error: the
    connector's policy decides whether it is computed here or fails)."""

    request: Request
    block_hashes: list
    error: KVTransferError | None = None


@dataclass(slots=True)
class ReceiveStats:
    num_blocks: int = 0
    num_bytes: int = 0
    failures: Counter[FailureReason] = field(default_factory=Counter)
    seconds: LatencyHistogram = field(default_factory=LatencyHistogram)  # successful loads


class KVConsumer:
    """Loads handed-over prompts into `memory` (its KV tensors `tensors`) through links."""

    def __init__(self, memory: KVMemory, tensors: Sequence[torch.Tensor], link_for: LinkFactory,
                 timeout_seconds: float, is_quiet: Callable[[], bool] = lambda: True) -> None:
        self.memory = memory
        self._tensors = tuple(tensors)
        self._link_for = link_for
        self.timeout_seconds = timeout_seconds
        self._is_quiet = is_quiet
        self._loading: dict[str, _Load] = {}
        self._held: dict[str, BlockTable] = {}  # request id -> its loaded blocks
        self._quarantined: list[_Load] = []  # given up while their transfer may still run
        self._ready: list[Loaded] = []
        self._done = threading.Event()
        self._threads = ThreadPoolExecutor(MAX_CONCURRENT_LOADS, "kv-load")
        self.stats = ReceiveStats()

    def held_block_ids(self) -> list[int]:
        """The blocks every load holds a reference on (a block twice if held twice)."""
        tables = [*(load.table for load in [*self._loading.values(), *self._quarantined]),
                  *self._held.values()]
        return [block_id for table in tables for block_id in table.live_block_ids]

    @property
    def num_loading(self) -> int:
        return len(self._loading)

    @property
    def num_pending(self) -> int:
        """Requests loading, or loaded and not yet handed to the scheduler."""
        return len(self._loading) + len(self._ready)

    @property
    def has_pending(self) -> bool:
        return self.num_pending > 0

    # ---------------------------------------------------------- step thread
    def start(self, request: Request, block_hashes: list, remote: RemotePrefill,
              now: float) -> bool:
        """Begin loading `request`'s prompt from `remote`; False when it needs no load (its
        blocks are cached here already, or there are none): it goes to the scheduler now."""
        prompt = request.prompt_token_ids
        if remote.num_tokens != len(prompt) or remote.token_digest != token_digest(prompt):
            return self._refuse(request, block_hashes, remote, KVTransferError(
                "prompt", f"the producer's blocks hold a prompt of {remote.num_tokens} tokens "
                          f"that is not this request's ({len(prompt)} tokens)"))
        size = self.memory.layout.block_size
        num_blocks = min(len(remote.block_ids), (len(prompt) - 1) // size)
        table = self.memory.new_block_table()
        table.take_prefix(self.memory.match_prefix(block_hashes[:num_blocks],
                                                   prompt[: num_blocks * size]))
        first = table.num_blocks
        if first == num_blocks:  # all cached here: nothing to read
            table.free()
            self._threads.submit(self._release, remote)
            return False
        # Loads keep the admission watermark free: blocks held for requests not yet admitted
        # must never starve the running ones.
        if not self.memory.grow_until_allocatable(num_blocks - first, keep_watermark=True):
            table.free()
            return self._refuse(request, block_hashes, remote, KVTransferError(
                "no_room", f"no room to load {num_blocks - first} blocks into"))
        table.append_slots((num_blocks - first) * size)
        pairs = list(zip(table.block_ids[first:], remote.block_ids[first:num_blocks],
                         strict=True))
        load = _Load(request, block_hashes, remote, table, pairs, now)
        self._loading[request.request_id] = load
        load.future = self._threads.submit(self._run, load)
        load.future.add_done_callback(lambda _: self._done.set())
        return True

    def collect(self, now: float) -> list[Loaded]:
        """Requests whose load ended (or overran its deadline) since the last call."""
        for request_id, load in list(self._loading.items()):
            if load.future.done():
                del self._loading[request_id]
                self._finish_load(load)
            elif now - load.started > self.timeout_seconds:
                del self._loading[request_id]
                self._quarantined.append(load)  # its transfer may still write
                self._give_up(load, KVTransferError(
                    "timeout", f"loading {len(load.pairs)} blocks took over "
                               f"{self.timeout_seconds} s"))
        self._free_quarantined()
        ready, self._ready = self._ready, []
        return ready

    def _free_quarantined(self) -> None:
        """Blocks of loads given up go back once their thread returned and the transfer
        engine runs no transfer past its deadline (one could still write them)."""
        if not self._quarantined or not self._is_quiet():
            return
        for load in [load for load in self._quarantined if load.future.done()]:
            load.table.free()
            self._quarantined.remove(load)

    def wait(self, timeout: float) -> None:
        """Block until a load ends or `timeout` passes (a step with nothing else to do); at
        once if one has ended since the last `collect` (its signal may have been cleared)."""
        if any(load.future.done() for load in self._loading.values()):
            return
        self._done.wait(timeout)
        self._done.clear()

    def abort(self, request_id: str) -> None:
        """Forget a loading or held request; a load in flight frees its blocks when it ends."""
        load = self._loading.get(request_id)
        if load is not None:
            load.aborted = True
        self.finish(request_id)
        self._ready = [r for r in self._ready if r.request.request_id != request_id]

    def finish(self, request_id: str) -> None:
        """The request ended: the loaded blocks it held go back (cached, for the next)."""
        table = self._held.pop(request_id, None)
        if table is not None:
            table.free()

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)

    def _finish_load(self, load: _Load) -> None:
        error = load.future.exception()
        if load.aborted:
            load.table.free()
            return
        if error is None:
            request = load.request
            load.table.mark_computed(load.table.num_tokens,
                                     lambda start, end: request.prompt_token_ids[start:end],
                                     load.block_hashes)
            self._held[request.request_id] = load.table
            self.stats.num_blocks += len(load.pairs)
            self.stats.num_bytes += len(load.pairs) * self.memory.layout.bytes_per_block
            self.stats.seconds.observe(time.monotonic() - load.started)
            self._ready.append(Loaded(request, load.block_hashes))
            return
        load.table.free()
        if isinstance(error, IncompatibleKVError):
            error = KVTransferError("incompatible", str(error))
        elif not isinstance(error, KVTransferError):
            error = KVTransferError("failed", f"{type(error).__name__}: {error}")
        self._give_up(load, error)

    def _give_up(self, load: _Load, error: KVTransferError) -> None:
        self.stats.failures[error.reason] += 1
        logger.warning("KV load for request %s failed: %s", load.request.request_id, error)
        if not load.aborted:
            self._ready.append(Loaded(load.request, load.block_hashes, error))

    def _refuse(self, request: Request, block_hashes: list, remote: RemotePrefill,
                error: KVTransferError) -> bool:
        """A handover not loaded at all: the lease goes back, the request follows the
        policy (through `collect`)."""
        self.stats.failures[error.reason] += 1
        self._threads.submit(self._release, remote)
        self._ready.append(Loaded(request, block_hashes, error))
        return True

    # -------------------------------------------------------- worker thread
    def _run(self, load: _Load) -> None:
        remote = load.remote
        local_ids = {remote_id: local_id for local_id, remote_id in load.pairs}
        leased = [(b, g) for b, g in remote.pairs if b in local_ids]
        # Our own prompt's digest, not the request's word for it: the producer refuses a
        # lease granted for another prompt.
        digest = token_digest(load.request.prompt_token_ids)
        link = self._link_for(remote)
        try:
            link.check(remote.lease_id, digest, leased)
            link.read(load.pairs)
            expected = link.checksums(remote.lease_id, digest, leased)
            verify_blocks(self._tensors, [(local_ids[b], b) for b, _ in leased], expected)
        finally:
            self._release(remote, link)

    def _release(self, remote: RemotePrefill, link: PeerLink | None = None) -> None:
        """Best effort: a producer that does not hear it lets the lease expire."""
        try:
            (link or self._link_for(remote)).release(remote.lease_id)
        except Exception as error:
            logger.info("could not release lease %s at %s: %s", remote.lease_id,
                        remote.engine_id, error)

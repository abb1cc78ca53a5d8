"""Block copies between the device pool and the tiers below it, queued while a step is
scheduled and run together before its model does.

Scheduling decides what moves (a spill when the device evicts a cached block, a swap-out when
a sequence is preempted, a swap-in or a prefix reload when one is admitted) but moves nothing:
no KV is written until the runner's copies and forward. `run()` then copies in an order that
keeps every read ahead of any write that could clobber it:

    1. device → host     spills and swap-outs: their device blocks may be reused this step
    2. host → device     swap-ins and host reloads
       disk → device     disk reloads (blocks already read and validated)
    3. host blocks held for the copies get their references back

A host block that a queued copy reads or writes is *held* (one reference) from the moment the
copy is queued until it is done, so the host LRU and the disk tier never see it mid-copy.

On the CPU every copy is a `memcpy` at `run()` and nothing overlaps. On CUDA the copies run on
a side stream: it first waits for everything the compute stream has queued (the KV they read
is written), then copies from and to page-locked host memory without blocking the CPU. The
compute stream waits for the copies (a device-side wait, the CPU goes on) only when the step
needs them: always after a reload or swap-in, and after a spill or swap-out only if the step
writes one of the device blocks that copy reads (otherwise the copy-out overlaps the step's
compute). Held host blocks are released once the side stream's event reports the copies done.
Snapshots for the disk tier (`snapshot`) are copied on the side stream after the step's
compute; the disk tier's writer thread waits for them, and a later step only if it writes one
of the blocks being read (an evicted block reused), like a copy-out.

An elastic resize (`kvpool.memory.elastic_pool`) relocates and zeroes device blocks on the
compute stream, outside any step: before it does, the compute stream waits for every copy in
flight (`wait_all`, on the pool's `pool_resizing`), since a block a copy-out still reads may
be a relocation's destination, or come back online (zeroed) in a regrown segment.

The side stream is a `SideStream` (`kvpool.memory.tiers.side_stream`): None on the CPU.

A copy that raises fails the whole batch: the blocks it was to fill are reported unfilled
(`on_unfilled(device ids, host ids)`: reloads and swap-ins on the device, spills and swap-outs
on the host; their prefix-cache entries must go, their KV may never have arrived), the host
blocks held for it are released once nothing can still read them, and the error goes on to
the step, which is rolled back. (A swapped-out sequence whose copy failed is not told: it
would resume from that host copy.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import torch

from kvpool.memory.kv_cache import KVCache
from kvpool.memory.tiers.side_stream import SideStream


@dataclass(slots=True)
class _Batch:
    """The copies queued since the last `run()`."""

    out: list[tuple[int, int]] = field(default_factory=list)  # (device id, host id)
    in_: list[tuple[int, int]] = field(default_factory=list)  # (host id, device id)
    from_disk: list[tuple[torch.Tensor, torch.Tensor | None, int]] = field(default_factory=list)
    held_host_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Copies of device blocks' KV on the CPU, safe to read once `ready` (None: now)."""

    kv: torch.Tensor  # [num_blocks, *layout.block_shape]
    scales: torch.Tensor | None  # [num_blocks, *layout.scale_block_shape]
    ready: torch.cuda.Event | None


class KVTransfers:
    """The queue of block copies between `device` and `host` (None: no host tier)."""

    def __init__(self, device: KVCache, host: KVCache | None, release_host,
                 side_stream: SideStream | None = None,
                 on_unfilled: Callable[[list[int], list[int]], None] = lambda d, h: None,
                 ) -> None:
        """`release_host(ids)` drops the references held on host blocks for their copies;
        `side_stream`: the stream copies run on (default: one on a CUDA device, none on the
        CPU; tests pass an ordering model); `on_unfilled(device ids, host ids)`: the blocks a
        failed batch was to fill."""
        self.device = device
        self.host = host
        self._release_host = release_host
        self._on_unfilled = on_unfilled
        self._batch = _Batch()
        self.side_stream = side_stream or SideStream.for_device(device.tensor.device)
        # With a side stream only: copies issued but maybe unfinished: (event, device ids the
        # side stream reads, host ids held until done).
        self._in_flight: list[tuple[torch.cuda.Event, set[int], list[int]]] = []

    @property
    def num_queued(self) -> int:
        batch = self._batch
        return len(batch.out) + len(batch.in_) + len(batch.from_disk)

    @property
    def num_held_host_blocks(self) -> int:
        return len(self._batch.held_host_ids) + sum(len(h) for _, _, h in self._in_flight)

    # ----------------------------------------------------------------- queue
    def device_to_host(self, device_ids: Sequence[int], host_ids: Sequence[int],
                       hold: bool = False) -> None:
        """Queue copies of device blocks into host blocks (`hold`: the queue owns one
        reference on each host block until the copy is done)."""
        self._batch.out.extend(zip(device_ids, host_ids, strict=True))
        if hold:
            self._batch.held_host_ids.extend(host_ids)

    def host_to_device(self, host_ids: Sequence[int], device_ids: Sequence[int]) -> None:
        """Queue copies of host blocks into device blocks; the queue owns one reference on
        each host block and drops it once the copy is done."""
        self._batch.in_.extend(zip(host_ids, device_ids, strict=True))
        self._batch.held_host_ids.extend(host_ids)

    def disk_to_device(self, kv: torch.Tensor, scales: torch.Tensor | None,
                       device_id: int) -> None:
        """Queue a copy of a block read from disk (CPU tensors) into a device block."""
        self._batch.from_disk.append((kv, scales, device_id))

    # ------------------------------------------------------------------- run
    def run(self, written_block_ids: Callable[[], Collection[int]] = frozenset) -> None:
        """Carry out every queued copy (module docstring); `written_block_ids()` are the device
        blocks the coming step writes (asked on CUDA only, to decide what it must wait for)."""
        batch, self._batch = self._batch, _Batch()
        if self.side_stream is None:
            self._copy_or_abandon(batch, non_blocking=False)
            if batch.held_host_ids:
                self._release_host(batch.held_host_ids)
            return
        self._run_on_side_stream(batch, written_block_ids)

    def run_copy_outs(self, written_block_ids: Callable[[], Collection[int]] = frozenset
                      ) -> None:
        """Carry out the queued device → host copies now, ahead of the rest: a hybrid pool's
        groups share the device bytes (a page one group spills may be another's reload target
        this step), so every group's copy-outs read before any group's copy-in writes. With a
        side stream shared by the groups, stream order keeps them so."""
        batch = self._batch
        if not batch.out:
            return
        outs = _Batch(out=batch.out)
        batch.out = []
        if self.side_stream is None:
            self._copy_or_abandon(outs, non_blocking=False)
        else:
            self._run_on_side_stream(outs, written_block_ids)

    def _copy_or_abandon(self, batch: _Batch, non_blocking: bool) -> None:
        """`_copy`; if it raises: what was queued finishes, the batch's destinations are
        reported unfilled and its held host blocks released, and the error goes on."""
        try:
            self._copy(batch, non_blocking)
        except BaseException:
            if self.side_stream is not None:
                self.side_stream.synchronize()  # nothing queued may still read a host block
            self._on_unfilled([device_id for _, device_id in batch.in_]
                              + [device_id for _, _, device_id in batch.from_disk],
                              [host_id for _, host_id in batch.out])
            if batch.held_host_ids:
                self._release_host(batch.held_host_ids)
            raise

    def _copy(self, batch: _Batch, non_blocking: bool) -> None:
        device, host = self.device, self.host
        for device_id, host_id in batch.out:
            copy_block(host, host_id, device, device_id, non_blocking)
        for host_id, device_id in batch.in_:
            copy_block(device, device_id, host, host_id, non_blocking)
        for kv, scales, device_id in batch.from_disk:
            device.tensor[device_id].copy_(kv, non_blocking=non_blocking)
            if scales is not None:
                device.scales[device_id].copy_(scales, non_blocking=non_blocking)

    def _run_on_side_stream(self, batch: _Batch,
                            written_block_ids: Callable[[], Collection[int]]) -> None:
        side = self.side_stream
        self._retire_finished()
        if batch.out or batch.in_ or batch.from_disk:
            side.wait_for_compute()
            with side.copying():
                self._copy_or_abandon(batch, non_blocking=True)
            event = side.record_event()
            copied_out = {device_id for device_id, _ in batch.out}
            self._in_flight.append((event, copied_out, batch.held_host_ids))
            if batch.in_ or batch.from_disk:
                side.make_compute_wait(event)  # the step reads what was just loaded
        if not any(copied_out for _, copied_out, _ in self._in_flight):
            return
        written = set(written_block_ids())
        for event, copied_out, _ in self._in_flight:
            if copied_out & written:
                side.make_compute_wait(event)

    def _retire_finished(self) -> None:
        still_running = []
        for event, copied_out, held in self._in_flight:
            if event.query():
                if held:
                    self._release_host(held)
            else:
                still_running.append((event, copied_out, held))
        self._in_flight = still_running

    def wait_all(self) -> None:
        """Make the compute stream wait for every copy in flight, device side (`pool_resizing`:
        an elastic resize is about to relocate or zero device blocks on it). Copies queued
        but not yet run name online blocks only, which a grow does not touch; a shrink comes
        between steps, when none is queued."""
        if self.side_stream is None:
            return  # the CPU's copies were done by `run()`
        self._retire_finished()
        for event, _, _ in self._in_flight:
            self.side_stream.make_compute_wait(event)

    def synchronize(self) -> None:
        """Run what is queued and wait for every copy (shutdown, reset, tests)."""
        self.run()
        if self.side_stream is not None:
            self.side_stream.synchronize()
            self._retire_finished()
        assert not self._in_flight and self.num_queued == 0

    # -------------------------------------------------------------- snapshot
    def snapshot(self, device_ids: Sequence[int]) -> Snapshot:
        """CPU copies of `device_ids`' KV (after everything the compute stream queued)."""
        device = self.device
        index = torch.tensor(device_ids, dtype=torch.int64, device=device.tensor.device)
        side = self.side_stream
        if side is None:
            scales = None if device.scales is None else device.scales[index]
            return Snapshot(device.tensor[index], scales, None)
        side.wait_for_compute()
        with side.copying():
            kv = side.to_host(device.tensor[index])
            scales = None if device.scales is None else side.to_host(device.scales[index])
        side.reads(index)  # made on the compute stream, read on the side stream
        event = side.record_event()
        # The side stream reads these blocks: a step that writes one waits for it (`run`).
        self._in_flight.append((event, set(device_ids), []))
        return Snapshot(kv, scales, event)


def copy_block(dst: KVCache, dst_id: int, src: KVCache, src_id: int, non_blocking: bool) -> None:
    """One block (codes and scales), one contiguous copy each."""
    dst.tensor[dst_id].copy_(src.tensor[src_id], non_blocking=non_blocking)
    if src.scales is not None:
        dst.scales[dst_id].copy_(src.scales[src_id], non_blocking=non_blocking)

"""Block copies between the device pool and the host tier: the order that keeps reads ahead of
clobbering writes, held host blocks released once copied, and (on CUDA) the same results from
the side stream with events, the compute stream waiting only when it must; an elastic resize
waits for the copies in flight (on the CPU, checked with the side stream's ordering model,
tests/memory/side_stream_model.py; on CUDA, with a side stream held back on purpose)."""

from __future__ import annotations

import pytest
import torch

from kvpool.memory.block_table import BlockTable
from kvpool.memory.elastic_pool import ElasticPoolConfig
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.tiers.kv_transfer import KVTransfers
from tests.memory.arena_checks import DEVICES
from tests.memory.side_stream_model import ModelSideStream

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)


def memory_on(device: str, layout: KVLayout = LAYOUT) -> KVMemory:
    return KVMemory(layout, 8, device, host_num_bytes=9 * layout.bytes_per_block)


def fill(memory: KVMemory, block_id: int, value: float) -> None:
    memory.kv_cache.tensor[block_id] = value
    if memory.kv_cache.scales is not None:
        memory.kv_cache.scales[block_id] = value + 0.5


@pytest.mark.parametrize("device", DEVICES)
def test_a_block_evicted_and_reused_in_one_step_is_copied_out_before_it_is_overwritten(device):
    """Device block 1 is spilled to host block 1 and, in the same step, receives host block 2
    (a swap-in): out first, then in; the held host blocks are released after."""
    memory = memory_on(device)
    tiers, host = memory.tiers, memory.tiers.host
    fill(memory, 1, 7.0)
    [swapped] = host.pool.allocate(1)
    host.kv_cache.tensor[swapped] = 3.0
    [spill_to] = host.pool.allocate(1)
    tiers.transfers.device_to_host([1], [spill_to], hold=True)  # the queue's reference...
    tiers.swap_in([swapped], [1])  # ...and this one pass to the queue too
    assert tiers.transfers.num_held_host_blocks == 2
    tiers.before_step()
    tiers.transfers.synchronize()
    assert (host.kv_cache.tensor[spill_to] == 7.0).all()
    assert (memory.kv_cache.tensor[1] == 3.0).all()
    assert host.pool.num_used_blocks == 0 and tiers.transfers.num_held_host_blocks == 0
    host.check_invariants()


@pytest.mark.parametrize("device", DEVICES)
def test_swap_out_and_back_moves_codes_and_scales(device):
    memory = memory_on(device, KVLayout(4, 2, 2, 8, "int8"))
    tiers = memory.tiers
    for block_id in (1, 2, 3):
        fill(memory, block_id, float(block_id))
    host_ids = tiers.swap_out([1, 2, 3])
    tiers.before_step()
    for block_id in (1, 2, 3):
        fill(memory, block_id, 0.0)  # the device blocks are reused meanwhile
    tiers.swap_in(host_ids, [3, 2, 1])
    tiers.before_step()
    tiers.transfers.synchronize()
    for source, destination in zip((1, 2, 3), (3, 2, 1), strict=True):
        assert (memory.kv_cache.tensor[destination] == source).all()
        assert (memory.kv_cache.scales[destination] == source + 0.5).all()
    assert memory.tiers.host.pool.num_used_blocks == 0


@pytest.mark.parametrize("device", DEVICES)
def test_a_snapshot_is_the_blocks_as_computed(device):
    memory = memory_on(device)
    fill(memory, 4, 5.0)
    snapshot = memory.tiers.transfers.snapshot([4])
    memory.tiers.before_step(lambda: {4})  # the next step writes block 4...
    fill(memory, 4, 6.0)  # ...after the snapshot's copy (CUDA: the compute stream waits)
    if snapshot.ready is not None:
        snapshot.ready.synchronize()
    assert snapshot.kv.device == torch.device("cpu") and (snapshot.kv == 5.0).all()


def test_a_snapshots_block_ids_outlive_the_side_streams_read_of_them():
    # The ids tensor comes from the compute stream's pool; the side stream gathers with it.
    model = ModelSideStream()
    memory = memory_on("cpu")
    transfers = KVTransfers(memory.kv_cache, memory.tiers.host.kv_cache,
                            memory.tiers.host.pool.free, model)
    fill(memory, 4, 5.0)
    fill(memory, 6, 2.0)
    snapshot = transfers.snapshot([6, 4])
    assert [ids.tolist() for ids in model.read_tensors] == [[6, 4]]
    assert (snapshot.kv[0] == 2.0).all() and (snapshot.kv[1] == 5.0).all()


def test_a_host_tier_smaller_than_two_blocks_is_none():
    assert memory_on("cpu").tiers.host.pool.num_blocks == 8
    assert KVMemory(LAYOUT, 8, host_num_bytes=LAYOUT.bytes_per_block).tiers.host is None
    assert not KVMemory(LAYOUT, 8).tiers.has_host


# ------------------------------------------------------------- elastic resizes
def elastic_memory(device: str, side_stream=None) -> KVMemory:
    """Segments of 4 blocks (ids 1..4 online at start, 5..8 after a grow) and a host tier;
    `side_stream` replaces the transfers' own (the CPU's ordering model)."""
    elastic = ElasticPoolConfig(segment_blocks=4, initial_blocks=4, idle_seconds=0.0)
    memory = KVMemory(LAYOUT, 8, device, elastic=elastic,
                      host_num_bytes=9 * LAYOUT.bytes_per_block)
    if side_stream is not None:
        host = memory.tiers.host
        memory.tiers.transfers = KVTransfers(memory.kv_cache, host.kv_cache, host.pool.free,
                                             side_stream)
    return memory


def relocate_onto_a_copy_out(memory: KVMemory, before_copy=lambda: None) -> list[int]:
    """Blocks 1..3 used, block 4 swapped out (its copy to the host in flight) and freed,
    block 5 (the grown segment) used; a shrink gives the grown segment back, relocating
    block 5 into block 4, the copy's source. Returns the swapped-out host block."""
    pool, block_size = memory.pool, LAYOUT.block_size
    kept, swapped, moved = BlockTable(pool), BlockTable(pool), BlockTable(pool)
    kept.append_slots(3 * block_size)
    swapped.append_slots(block_size)
    assert memory.sizing.grow()
    moved.append_slots(block_size)
    assert (kept.block_ids, swapped.block_ids, moved.block_ids) == ([1, 2, 3], [4], [5])
    fill(memory, 4, 7.0)
    fill(memory, 5, 3.0)
    host_ids = memory.tiers.swap_out([4])
    swapped.free()
    before_copy()
    memory.tiers.before_step()
    assert memory.sizing.shrink([kept, moved])
    assert moved.block_ids == [4]
    memory.tiers.transfers.synchronize()
    kept.free()
    moved.free()
    return host_ids


def record_unordered(monkeypatch, obj, name: str, model: ModelSideStream) -> list[int]:
    """Wrap `obj.name`: each call records how many copies in flight compute did not wait for."""
    seen: list[int] = []
    method = getattr(obj, name)

    def recording(*args, **kwargs):
        seen.append(len(model.unordered()))
        return method(*args, **kwargs)

    monkeypatch.setattr(obj, name, recording)
    return seen


def test_a_shrink_waits_for_copies_in_flight_before_relocating(monkeypatch):
    model = ModelSideStream()
    memory = elastic_memory("cpu", model)
    seen = record_unordered(monkeypatch, memory.kv_cache, "copy_blocks", model)
    host_ids = relocate_onto_a_copy_out(memory)
    assert seen == [0]  # the relocation came after the copy-out, on the compute stream
    host = memory.tiers.host
    assert (host.kv_cache.tensor[host_ids[0]] == 7.0).all()
    host.pool.free(host_ids)
    memory.check_invariants()


def test_a_grow_waits_for_copies_in_flight_before_zeroing(monkeypatch):
    model = ModelSideStream()
    memory = elastic_memory("cpu", model)
    table = BlockTable(memory.pool)
    table.append_slots(LAYOUT.block_size)
    host_ids = memory.tiers.swap_out(table.block_ids)
    memory.tiers.before_step()
    assert len(model.unordered()) == 1  # the copy-out is in flight
    seen = record_unordered(monkeypatch, memory.arena, "allocate", model)
    assert memory.sizing.grow()
    assert seen == [0]  # the new segment's bytes are zeroed after it
    model.finish()
    memory.tiers.transfers.synchronize()
    memory.tiers.host.pool.free(host_ids)
    table.free()
    memory.check_invariants()


@pytest.mark.parametrize("device", DEVICES[1:])  # CUDA only: the CPU's copies never overlap
def test_a_shrink_never_relocates_into_a_block_a_copy_out_still_reads(device):
    """The side stream is held back (a sleep kernel queued before the copy), so a relocation
    the compute stream ran without waiting would land before the copy read block 4."""
    memory = elastic_memory(device)
    side = memory.tiers.transfers.side_stream

    def hold_back_the_side_stream():
        with side.copying():
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles

    host_ids = relocate_onto_a_copy_out(memory, hold_back_the_side_stream)
    host = memory.tiers.host
    assert (host.kv_cache.tensor[host_ids[0]] == 7.0).all()  # the copy read block 4 first
    assert (memory.kv_cache.tensor[4] == 3.0).all()  # then block 5's KV moved in
    host.pool.free(host_ids)
    memory.check_invariants()


def test_a_failed_copy_unpublishes_the_blocks_it_was_to_fill_and_releases_the_host():
    """A spill (device 1 -> a published host block) and a reload (a host block -> device 2,
    published at admission) in one batch whose copy raises: neither block stays findable,
    and the host references held for the copies are dropped."""
    memory = memory_on("cpu")
    tiers, host = memory.tiers, memory.tiers.host
    tokens = list(range(LAYOUT.block_size))
    [spilled] = host.pool.allocate(1)
    host.pool.publish(spilled, b"s" * 32, tokens)
    tiers.transfers.device_to_host([1], [spilled], hold=True)
    [source] = host.pool.allocate(1)
    [reloaded] = memory.pool.allocate(1)
    memory.pool.publish(reloaded, b"r" * 32, tokens)
    tiers.transfers.host_to_device([source], [reloaded])

    def fail(*args, **kwargs):
        raise RuntimeError("the copy fell over")

    tiers.transfers._copy = fail
    with pytest.raises(RuntimeError, match="fell over"):
        tiers.before_step()
    assert not host.pool.prefix_cache.holds(b"s" * 32)
    assert not memory.pool.prefix_cache.holds(b"r" * 32)
    assert host.pool.num_used_blocks == 0 and tiers.transfers.num_held_host_blocks == 0
    memory.pool.free([reloaded])
    memory.check_invariants()

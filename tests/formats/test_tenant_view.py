"""`KVSnapshot.restricted_to`, a tenant's view, on a hand-made five-block pool: the viewer's
blocks keep their hash and age; another tenant's used block is "other"; a cached block (held by
nobody) keeps its state but loses its hash and age; the LRU order and the evictions go."""

from __future__ import annotations

from dataclasses import fields

from kvpool.formats.kv_snapshot import (
    CACHED,
    FREE,
    OFFLINE,
    OTHER,
    USED,
    BlockRun,
    DerivedFigures,
    KVSnapshot,
    PoolView,
    SequenceView,
)
from kvpool.memory.block_pool import BlockPoolStats


def zeros(cls):
    return cls(**{field.name: 0 for field in fields(cls)})


def snapshot() -> KVSnapshot:
    device = PoolView(
        block_size=4, num_blocks=4, capacity_blocks=5, bytes_per_block=64,
        kv_cache_dtype="float32",
        runs=(BlockRun(0, 1, OFFLINE, 0, 0), BlockRun(1, 1, USED, 1, 4, (0,)),
              BlockRun(2, 1, USED, 1, 4, (1,)), BlockRun(3, 1, CACHED, 0, 4),
              BlockRun(4, 1, FREE, 0, 0)),
        hashes={1: "aa" * 8, 2: "bb" * 8, 3: "cc" * 8},
        ages=((1, 3, 2.5), (4, 1, None)), lru=(3,))
    sequences = (SequenceView("req-a", 0, "running", 4, 4, (1,), tenant="a"),
                 SequenceView("req-b", 0, "running", 4, 4, (2,), tenant="b"))
    return KVSnapshot(0.0, 7, {"device": device}, sequences, zeros(BlockPoolStats),
                      zeros(DerivedFigures), recent_evictions=("dd" * 4,))


def test_a_tenant_sees_hashes_and_ages_of_its_own_blocks_only() -> None:
    view = snapshot().restricted_to(lambda seq: seq.tenant == "b")
    device = view.device
    assert [seq.request_id for seq in view.sequences] == ["req-b"]
    assert [(run.first_id, run.state, run.holders) for run in device.runs] == [
        (0, OFFLINE, ()), (1, OTHER, ()), (2, USED, (0,)), (3, CACHED, ()), (4, FREE, ())]
    assert dict(device.hashes) == {2: "bb" * 8}
    assert device.ages == ((1, 1, None), (2, 1, 2.5), (3, 2, None))
    assert device.lru == () and view.recent_evictions == ()
    assert device.count(CACHED) == 1  # counts stay whole
    whole = snapshot()
    assert whole.device.lru == (3,) and dict(whole.device.hashes)[3] == "cc" * 8

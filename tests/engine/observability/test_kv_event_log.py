"""KVEventLog over tiny pools: the wire format, exact events for publish / evict / shrink /
relocate / reset, and a state machine checking that the batches, applied in order, always
give what the device and host prefix caches hold, with parents and tokens that re-hash."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvpool.engine.observability.event_log import KVEventLog
from kvpool.engine.observability.events_config import KVEventsConfig
from kvpool.formats.kv_events import (
    DEVICE,
    HOST,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_message,
    encode_message,
)
from kvpool.formats.kv_media import group_medium, split_medium
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory
from kvpool.memory.prefix_cache import hash_block, hash_full_blocks, salt_key
from kvpool.memory.resizable_block_pool import ResizableBlockPool
from kvpool.memory.sequence_blocks import SequenceBlocks
from kvpool.router.prefix_index import PrefixIndex
from tests.memory.hybrid_checks import gemma_like_groups, hybrid_pool

CONFIG = KVEventsConfig(True, publisher="null", topic="kv", include_token_ids=True)
LAYOUT = KVLayout(block_size=2)


class RecordingPublisher:
    """Keeps every batch, sent through the wire format and back."""

    name = "recording"
    endpoint = None

    def __init__(self) -> None:
        self.batches: list[tuple[int, KVEventBatch]] = []

    def publish(self, seq: int, batch: KVEventBatch) -> None:
        self.batches.append(decode_message(encode_message("kv", seq, batch)))

    def close(self) -> None:
        return None


def make_log(*pools: tuple[BlockPool, str]) -> tuple[KVEventLog, RecordingPublisher]:
    publisher = RecordingPublisher()
    log = KVEventLog(CONFIG, LAYOUT.block_size, publisher)
    for pool, medium in pools:
        assert pool.medium == medium
        log.attach(pool)
    return log, publisher


def events(publisher: RecordingPublisher) -> list:
    return [event for _, batch in publisher.batches for event in batch.events]


def test_the_wire_format_is_vllms() -> None:
    h0, h1 = bytes(32), bytes([1]) * 32
    batch = KVEventBatch(12.5, [BlockStored([h0, h1], None, [1, 2, 3, 4], 2, None, DEVICE),
                                BlockRemoved([h1], HOST), AllBlocksCleared()])
    frames = encode_message("kv", 258, batch)
    assert frames[:2] == [b"kv", b"\x00\x00\x00\x00\x00\x00\x01\x02"]
    assert msgspec.msgpack.decode(frames[2]) == [  # array-like and tagged, as vLLM's are
        12.5, [["BlockStored", [h0, h1], None, [1, 2, 3, 4], 2, None, "device"],
               ["BlockRemoved", [h1], "host"], ["AllBlocksCleared"]], None]
    assert decode_message(frames) == (258, batch)


@pytest.mark.parametrize("frames", [[b"kv", bytes(8)], [b"kv", bytes(7), b"\x90"],
                                    [b"kv", bytes(8), b"\xc1"]])
def test_a_malformed_message_is_a_value_error(frames) -> None:
    with pytest.raises(ValueError):
        decode_message(frames)


def test_a_chain_is_one_event_and_a_shared_prefix_names_its_parent() -> None:
    pool = BlockPool(8, LAYOUT)
    log, publisher = make_log((pool, DEVICE))
    first = SequenceBlocks(pool, "t")
    first.append_tokens([1, 2, 3, 4, 5, 6, 7])  # three full blocks, published in order
    second = SequenceBlocks(pool, "t")
    second.take_cached_prefix([1, 2, 3, 4, 9, 9])
    second.append_tokens([9, 9])
    log.drain()
    log.drain()  # nothing new: no batch
    chain = hash_full_blocks([1, 2, 3, 4, 5, 6], 2, salt_key("t"))
    branch = hash_full_blocks([1, 2, 3, 4, 9, 9], 2, salt_key("t"))
    assert [seq for seq, _ in publisher.batches] == [1]
    assert events(publisher) == [BlockStored(chain, None, [1, 2, 3, 4, 5, 6], 2, None, DEVICE),
                                 BlockStored(branch[2:], chain[1], [9, 9], 2, None, DEVICE)]
    first.free()
    second.free()


def test_evictions_for_reuse_are_removed_and_numbered_per_batch() -> None:
    pool = BlockPool(3, LAYOUT)
    log, publisher = make_log((pool, DEVICE))
    table = SequenceBlocks(pool)
    table.append_tokens([1, 2, 3, 4])
    table.free()
    log.drain()
    hashes = hash_full_blocks([1, 2, 3, 4], 2)
    pool.allocate(3)  # one fresh block, then the LRU (the tail block first)
    log.drain()
    assert [seq for seq, _ in publisher.batches] == [1, 2]
    assert publisher.batches[1][1].events == [BlockRemoved([hashes[1], hashes[0]], DEVICE)]


def test_an_elastic_shrink_is_removed_and_a_relocation_is_no_event() -> None:
    pool = ResizableBlockPool(8, LAYOUT)
    pool.add_blocks(range(1, 8))
    log, publisher = make_log((pool, DEVICE))
    kept, dropped = SequenceBlocks(pool), SequenceBlocks(pool)
    kept.append_tokens([1, 2])
    dropped.append_tokens([3, 4])
    dropped.free()
    log.drain()
    pool.relocate_blocks(kept.block_ids)
    pool.remove_blocks([block_id for block_id in range(1, 8) if pool.ref_count(block_id) == 0])
    log.drain()
    assert publisher.batches[-1][1].events == [BlockRemoved(hash_full_blocks([3, 4], 2), DEVICE)]
    assert log.snapshot().blocks == [(hash_full_blocks([1, 2], 2)[0], DEVICE)]


def test_a_spill_names_the_parent_the_device_published() -> None:
    device, host = BlockPool(4, LAYOUT), BlockPool(4, LAYOUT, medium=HOST)
    log, publisher = make_log((device, DEVICE), (host, HOST))
    table = SequenceBlocks(device)
    table.append_tokens([1, 2, 3, 4])
    hashes = list(table.block_hashes)
    [host_id] = host.allocate(1)
    host.publish(host_id, hashes[1], [3, 4])  # as KVTiers spills: no parent given
    host.free([host_id])
    log.drain()
    assert events(publisher)[-1] == BlockStored([hashes[1]], hashes[0], [3, 4], 2, None, HOST)
    table.free()


def test_reset_clears_all_once_every_tier_is_empty() -> None:
    device, host = BlockPool(4, LAYOUT), BlockPool(4, LAYOUT, medium=HOST)
    log, publisher = make_log((device, DEVICE), (host, HOST))
    table = SequenceBlocks(device)
    table.append_tokens([1, 2])
    table.free()
    [host_id] = host.allocate(1)
    host.publish(host_id, bytes(32), [7, 7])
    host.free([host_id])
    log.drain()
    host.reset()  # the device still holds a block: only the host's go
    device.reset()
    log.drain()
    assert publisher.batches[-1][1].events == [BlockRemoved([bytes(32)], HOST),
                                               AllBlocksCleared()]
    assert log.snapshot().blocks == [] and log._parent_by_hash == {}


SALTS = (None, "tenant-a")


class EventLogMachine(RuleBasedStateMachine):
    """Block tables on a device pool with a real host tier below (spills); after any rules,
    the batches drained so far, applied in order, equal the caches' contents."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = KVMemory(LAYOUT, 6, host_num_bytes=5 * LAYOUT.bytes_per_block)
        self.log, self.publisher = make_log((self.memory.pool, DEVICE),
                                            (self.memory.tiers.host.pool, HOST))
        self.tables: list[SequenceBlocks] = []
        self.index = PrefixIndex()
        self.num_applied = 0

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=7),
          salt=st.sampled_from(SALTS))
    def add_table(self, tokens: list[int], salt: str | None) -> None:
        table = SequenceBlocks(self.memory.pool, salt)
        table.take_cached_prefix(tokens)
        rest = tokens[table.num_tokens:]
        if table.num_blocks_to_append(len(rest)) > self.memory.pool.num_allocatable_blocks:
            table.free()
            return
        table.append_tokens(rest)
        self.memory.tiers.before_step()  # the spills' copies: their host holds released
        self.tables.append(table)

    @precondition(lambda self: self.tables)
    @rule(pick=st.integers(0, 100))
    def free_table(self, pick: int) -> None:
        self.tables.pop(pick % len(self.tables)).free()

    @precondition(lambda self: not self.tables)
    @rule()
    def reset(self) -> None:
        self.memory.reset()

    @rule()
    def drain(self) -> None:
        self.log.drain()

    @invariant()
    def batches_rebuild_the_caches(self) -> None:
        snapshot = self.log.snapshot()
        for seq, batch in self.publisher.batches[self.num_applied:]:
            assert seq == self.num_applied + 1
            self.index.apply(batch)
            self.num_applied += 1
            for event in batch.events:
                if type(event) is BlockStored:
                    assert_chained(event)
        assert snapshot.seq == self.num_applied
        assert self.index.blocks() == set(snapshot.blocks)
        assert self.log._parent_by_hash.keys() == {h for h, _ in snapshot.blocks}


def assert_chained(event: BlockStored) -> None:
    """Each hash is its parent's (the event's parent, then the previous hash) chained with
    its own tokens, under one of the salts in play."""
    size = event.block_size
    parent = event.parent_block_hash
    for i, block_hash in enumerate(event.block_hashes):
        tokens = event.token_ids[i * size:(i + 1) * size]
        assert block_hash in {hash_block(parent, tokens, salt_key(salt)) for salt in SALTS}
        parent = block_hash


TestEventLogMachine = EventLogMachine.TestCase
TestEventLogMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)


def test_a_hybrid_pools_groups_are_reported_under_their_own_mediums() -> None:
    """Each KV cache group's pool is a medium of its own ("device/g1"); events applied per
    medium give what each group caches, and the router's index keeps the first group's."""
    pool = hybrid_pool(gemma_like_groups(window=8), num_pages_of_largest=20)
    publisher = RecordingPublisher()
    log = KVEventLog(CONFIG, pool.block_size, publisher)
    for group, group_pool in enumerate(pool.pools):
        log.attach(group_pool, group)
    first = SequenceBlocks(pool)
    first.append_tokens(list(range(40)))  # 10 blocks published in each group
    first.append_tokens([40])  # the window's dead blocks dropped
    assert first.table.tables[1].num_dropped_blocks > 0  # dropped: still cached
    first.free()
    second = SequenceBlocks(pool)
    second.append_tokens(list(range(100, 125)))  # evicts some of the first's, group by group
    log.drain()
    held: dict[str, set[bytes]] = {"device": set(), "device/g1": set()}
    index = PrefixIndex()
    for _, batch in publisher.batches:
        index.apply(batch)
        for event in batch.events:
            if type(event) is BlockStored:
                held[event.medium].update(event.block_hashes)
            else:
                held[event.medium].difference_update(event.block_hashes)
    for group, group_pool in enumerate(pool.pools):
        assert held[group_medium(DEVICE, group)] == set(group_pool.prefix_cache.block_hashes())
    assert held["device"] != held["device/g1"]  # the groups evicted differently
    snapshot = log.snapshot()
    assert set(snapshot.blocks) == {(h, m) for m, hashes in held.items() for h in hashes}
    assert index.blocks() == {(h, DEVICE) for h in held["device"]}
    assert split_medium("device/g1") == (DEVICE, 1) and split_medium("host") == (HOST, 0)
    second.free()
    log.close()

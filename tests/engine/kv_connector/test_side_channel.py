"""The side channel over real ZMQ sockets on loopback (a server thread in this process, its gate
a real `KVProducer` over a block pool): hellos exchange descriptors and admit only compatible
peers, lease checks and checksums are answered for leased blocks only, a release ends the
lease at the producer's next tick, and nothing waits past its timeout."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
import zmq

from kvpool.engine.kv_connector.checksums import block_checksums
from kvpool.engine.kv_connector.errors import IncompatibleKVError, KVTransferError
from kvpool.engine.kv_connector.handshake import EngineDescriptor
from kvpool.engine.kv_connector.producer import KVProducer
from kvpool.engine.kv_connector.regions import kv_tensors, regions_of
from kvpool.engine.kv_connector.side_channel import (
    SideChannelServer,
    check_lease,
    fetch_checksums,
    handshake,
    release_lease,
)
from kvpool.memory.block_pool import BlockPool
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout

LAYOUT = KVLayout(block_size=4, num_layers=2, num_kv_heads=1, head_dim=4, dtype="float32")


def engine(engine_id: str, layout: KVLayout = LAYOUT) -> tuple[KVCache, EngineDescriptor]:
    cache = KVCache(layout, num_blocks=4)
    cache.tensor[1:].uniform_()
    regions = regions_of(kv_tensors(cache))
    return cache, EngineDescriptor(engine_id, "SmolLM2", layout, "127.0.0.1", 15000, regions)


@pytest.fixture
def server() -> Iterator[SideChannelServer]:
    """The server, its `cache`, its `producer` and `pairs`: blocks 1 and 3 leased as "L"."""
    cache, descriptor = engine("prefill")
    pool = BlockPool(3, LAYOUT)
    producer = KVProducer(pool, kv_tensors(cache), lease_seconds=3600)
    block_ids = pool.allocate(3)
    lease = producer.hand_over("L", [block_ids[0], block_ids[2]], "D", time.monotonic())
    pool.free(block_ids)  # the lease's references alone hold them now
    with SideChannelServer(descriptor, producer) as running:
        running.cache, running.producer, running.pairs = cache, producer, lease.pairs
        yield running


def test_a_hello_exchanges_descriptors_and_admits_the_peer(server) -> None:
    _, local = engine("decode")

    remote = handshake(server.endpoint, local)

    assert remote == server.descriptor
    assert server.peers == {"decode": local}


def test_an_incompatible_peer_is_refused_on_both_sides(server) -> None:
    _, local = engine("decode", replace(LAYOUT, block_size=8))

    with pytest.raises(IncompatibleKVError, match="block_size differs"):
        handshake(server.endpoint, local)

    assert server.peers == {}


def test_checksums_come_from_the_servers_leased_blocks(server) -> None:
    pairs = server.pairs[::-1]
    check_lease(server.endpoint, "L", "D", pairs)
    assert fetch_checksums(server.endpoint, "L", "D", pairs) == block_checksums(
        kv_tensors(server.cache), [block_id for block_id, _ in pairs])


@pytest.mark.parametrize(("lease_id", "digest", "pair", "refusal"), [
    ("L", "D", (2, 1), "block not leased"),  # block 2 was never leased: no checksum of it
    ("L", "D", None, "leased at generation"),  # a generation the lease does not hold
    ("M", "D", None, "unknown_lease"),
    ("L", "E", "own", "another prompt"),  # the lease's own blocks, for another prompt
])
def test_blocks_outside_a_live_lease_are_refused(server, lease_id, digest, pair,
                                                 refusal) -> None:
    block_id, generation = server.pairs[0]
    pair = {"own": (block_id, generation), None: (block_id, generation + 1)}.get(pair, pair)
    for ask in (check_lease, fetch_checksums):
        with pytest.raises(KVTransferError) as caught:
            ask(server.endpoint, lease_id, digest, [pair])
        assert caught.value.reason == "lease"
        assert refusal in str(caught.value)


def test_a_release_ends_the_lease_at_the_next_tick(server) -> None:
    release_lease(server.endpoint, "L")
    check_lease(server.endpoint, "L", "D", server.pairs)  # still live until the tick
    assert server.producer.tick(time.monotonic()) == ["L"]
    with pytest.raises(KVTransferError, match="released") as caught:
        fetch_checksums(server.endpoint, "L", "D", server.pairs)
    assert caught.value.reason == "lease"
    assert server.producer.leases.pool.num_used_blocks == 0


def test_a_bad_request_is_refused_and_the_server_goes_on(server) -> None:
    with pytest.raises(KVTransferError, match="pairs") as caught:
        fetch_checksums(server.endpoint, "L", "D", [(1, 2, 3)])
    assert caught.value.reason == "protocol"

    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.connect(server.endpoint)
    socket.send(b"not json")
    assert "error" in json.loads(socket.recv())
    socket.close(linger=0)
    assert len(fetch_checksums(server.endpoint, "L", "D", server.pairs[:1])) == 1


def test_no_answer_is_a_timeout(server) -> None:
    endpoint = server.endpoint
    server.close()

    with pytest.raises(KVTransferError, match="no answer") as caught:
        fetch_checksums(endpoint, "L", "D", server.pairs, timeout_seconds=0.2)
    assert caught.value.reason == "timeout"

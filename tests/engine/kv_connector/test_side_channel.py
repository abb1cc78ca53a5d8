"""The side channel over real ZMQ sockets on loopback (a server thread in this process):
hellos exchange descriptors and admit only compatible peers, checksum requests are answered
from the server's KV, and nothing waits past its timeout."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace

import pytest
import zmq

from kvpool.engine.kv_connector.checksums import block_checksums
from kvpool.engine.kv_connector.errors import IncompatibleKVError, KVTransferError
from kvpool.engine.kv_connector.handshake import EngineDescriptor
from kvpool.engine.kv_connector.regions import kv_tensors, regions_of
from kvpool.engine.kv_connector.side_channel import SideChannelServer, fetch_checksums, handshake
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
    cache, descriptor = engine("prefill")
    with SideChannelServer(descriptor, kv_tensors(cache)) as running:
        running.cache = cache
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


def test_checksums_come_from_the_servers_blocks(server) -> None:
    assert fetch_checksums(server.endpoint, [3, 1]) == block_checksums(
        kv_tensors(server.cache), [3, 1])


def test_a_bad_request_is_refused_and_the_server_goes_on(server) -> None:
    with pytest.raises(KVTransferError, match="outside") as caught:
        fetch_checksums(server.endpoint, [1, 4])
    assert caught.value.reason == "protocol"

    socket = zmq.Context.instance().socket(zmq.REQ)
    socket.connect(server.endpoint)
    socket.send(b"not json")
    assert "error" in json.loads(socket.recv())
    socket.close(linger=0)
    assert len(fetch_checksums(server.endpoint, [1])) == 1


def test_no_answer_is_a_timeout(server) -> None:
    endpoint = server.endpoint
    server.close()

    with pytest.raises(KVTransferError, match="no answer") as caught:
        fetch_checksums(endpoint, [1], timeout_seconds=0.2)
    assert caught.value.reason == "timeout"

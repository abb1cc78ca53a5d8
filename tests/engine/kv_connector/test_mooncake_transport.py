"""The Mooncake KV transport between real processes on loopback: a peer process
(`kv_peer`) holds a KV cache of known bytes; this process handshakes with it over the side
channel and reads or writes its blocks through a real Mooncake transfer engine over TCP.

Mooncake must be installed (`make setup` installs the `mooncake` extra; its Debian libraries
come with `make setup-test`): nothing here is skipped.
"""

from __future__ import annotations

import os
import re
import signal
import threading
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

try:
    import mooncake.engine  # noqa: F401 (present, or every test here fails with how to install)
except ImportError as error:
    pytest.fail(f"the Mooncake KV transport tests need the package mooncake-transfer-engine: "
                f"run `make setup-test`, or `apt-get install libibverbs1 librdmacm1 libnuma1` "
                f"and `pip install -e '.[mooncake]'` ({error})", pytrace=False)

from kvpool.bench.processes import free_port
from kvpool.engine.kv_connector.checksums import block_checksums, verify_blocks
from kvpool.engine.kv_connector.errors import IncompatibleKVError, KVTransferError
from kvpool.engine.kv_connector.handshake import EngineDescriptor
from kvpool.engine.kv_connector.mooncake_transport import MooncakeConfig, MooncakeTransport
from kvpool.engine.kv_connector.regions import kv_tensors
from kvpool.engine.kv_connector.side_channel import fetch_checksums, handshake
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout
from tests.engine.kv_connector.kv_peer import (
    DIGEST,
    LEASE_ID,
    MODEL,
    PeerProcess,
    filled_cache,
)

pytestmark = [pytest.mark.processes, pytest.mark.timeout(600)]

NUM_BLOCKS = 8
PEER_SEED = 1
LAYOUTS = {
    "float32": KVLayout(block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32"),
    "bfloat16": KVLayout(block_size=4, num_layers=3, num_kv_heads=2, head_dim=8,
                         dtype="bfloat16"),
    "int8": KVLayout(block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype="int8"),
}
FLOAT32 = LAYOUTS["float32"]
PAIRS = [(1, 5), (2, 6), (3, 7), (6, 2)]  # (local block id, remote block id)


class Local:
    """This process's side: a zeroed KV cache registered with a transport, and its descriptor."""

    def __init__(self, layout: KVLayout, timeout_seconds: float = 30.0,
                 cache: KVCache | None = None, engine_id: str = "local") -> None:
        self.cache = cache or KVCache(layout, NUM_BLOCKS)
        self.transport = MooncakeTransport(MooncakeConfig(timeout_seconds=timeout_seconds))
        self.transport.register(kv_tensors(self.cache))
        self.descriptor = self.transport.describe(engine_id, MODEL, layout)

    def handshake(self, peer: PeerProcess) -> EngineDescriptor:
        return handshake(peer.endpoint, self.descriptor)


@pytest.fixture
def start_peer(tmp_path: Path) -> Iterator:
    """start_peer(layout) -> a ready PeerProcess; every one started is killed at the end."""
    peers: list[PeerProcess] = []

    def start(layout: KVLayout = FLOAT32, seed: int = PEER_SEED) -> PeerProcess:
        peers.append(PeerProcess(layout, NUM_BLOCKS, seed, tmp_path / f"peer-{len(peers)}.log"))
        return peers[-1]

    yield start
    for peer in peers:
        peer.kill()


@pytest.fixture
def make_local() -> Iterator:
    """make(layout, ...) -> a Local; every transport made is closed at the end."""
    made: list[Local] = []

    def make(layout: KVLayout = FLOAT32, **kwargs) -> Local:
        made.append(Local(layout, **kwargs))
        return made[-1]

    yield make
    for local in made:
        local.transport.close()


def assert_blocks_equal(local: KVCache, source: KVCache, pairs: list[tuple[int, int]]) -> None:
    for local_id, remote_id in pairs:
        assert torch.equal(local.tensor[local_id], source.tensor[remote_id]), (local_id, remote_id)
        if source.scales is not None:
            assert torch.equal(local.scales[local_id], source.scales[remote_id])


@pytest.mark.parametrize("dtype", sorted(LAYOUTS))
def test_a_reader_gets_the_senders_bytes(dtype: str, start_peer, make_local) -> None:
    layout = LAYOUTS[dtype]
    peer, local = start_peer(layout), make_local(layout)
    remote = local.handshake(peer)
    assert remote.session_name == f"127.0.0.1:{peer.rpc_port}"

    local.transport.read_blocks(remote, PAIRS)

    assert_blocks_equal(local.cache, filled_cache(layout, NUM_BLOCKS, PEER_SEED), PAIRS)
    untouched = sorted(set(range(NUM_BLOCKS)) - {local_id for local_id, _ in PAIRS})
    assert all(not local.cache.tensor[block_id].any() for block_id in untouched)
    verify_blocks(kv_tensors(local.cache), PAIRS,
                  fetch_checksums(peer.endpoint, LEASE_ID, DIGEST,
                                  peer.pairs([remote_id for _, remote_id in PAIRS])))


def test_a_writer_puts_its_bytes_in_the_peers_blocks(start_peer, make_local) -> None:
    peer = start_peer()
    local = make_local(cache=filled_cache(FLOAT32, NUM_BLOCKS, seed=2))
    remote = local.handshake(peer)

    local.transport.write_blocks(remote, [(1, 3), (2, 4)])

    ours = block_checksums(kv_tensors(local.cache), [1, 2])
    before = block_checksums(kv_tensors(filled_cache(FLOAT32, NUM_BLOCKS, PEER_SEED)), [3, 4, 5])
    checksums = fetch_checksums(peer.endpoint, LEASE_ID, DIGEST, peer.pairs([3, 4, 5]))
    assert checksums == [*ours, before[2]]
    assert ours != before[:2]


@pytest.mark.parametrize(("field", "local_layout"), [
    ("block_size", replace(FLOAT32, block_size=8)),
    ("kv_dtype", replace(FLOAT32, dtype="bfloat16")),
])
def test_a_layout_mismatch_fails_the_handshake(field: str, local_layout: KVLayout, start_peer,
                                               make_local) -> None:
    peer, local = start_peer(FLOAT32), make_local(local_layout)

    with pytest.raises(IncompatibleKVError, match=field) as caught:
        local.handshake(peer)

    assert caught.value.field == field
    assert (caught.value.local, caught.value.remote) == (
        (8, 4) if field == "block_size" else ("bfloat16", "float32"))


def test_a_transfer_to_an_exited_peer_fails_with_no_hang(start_peer, make_local) -> None:
    peer, local = start_peer(), make_local(timeout_seconds=10.0)
    remote = local.handshake(peer)
    local.transport.read_blocks(remote, PAIRS[:1])
    assert peer.stop() == 0

    with pytest.raises(KVTransferError, match=re.escape(remote.session_name)) as caught:
        local.transport.read_blocks(remote, PAIRS[1:])

    assert caught.value.reason in ("failed", "timeout")
    with pytest.raises(KVTransferError, match="no answer") as caught:
        handshake(peer.endpoint, local.descriptor, timeout_seconds=1.0)
    assert caught.value.reason == "timeout"


@pytest.mark.parametrize("first_transfer", [True, False], ids=["cold", "warm"])
def test_a_stopped_peer_times_out_instead_of_hanging(first_transfer: bool, start_peer,
                                                     make_local) -> None:
    """A peer that stops answering (SIGSTOP) is the case Mooncake does not bound by itself
    when the transfer is the first to that peer (its segment opens then)."""
    peer, local = start_peer(), make_local(timeout_seconds=2.0)
    remote = local.handshake(peer)
    if not first_transfer:
        local.transport.read_blocks(remote, PAIRS[:1])
    os.kill(peer.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(KVTransferError, match=r"did not finish within 2\.0 s") as caught:
            local.transport.read_blocks(remote, PAIRS[1:])
        assert caught.value.reason == "timeout"
    finally:
        peer.kill()
    local.transport.close()  # waits for the abandoned transfer, which the kill ends
    assert local.transport.num_abandoned == 0


def test_a_corrupted_block_is_caught_by_its_checksum(start_peer, make_local) -> None:
    peer, local = start_peer(), make_local()
    local.transport.read_blocks(local.handshake(peer), PAIRS)
    checksums = fetch_checksums(peer.endpoint, LEASE_ID, DIGEST,
                                peer.pairs([remote_id for _, remote_id in PAIRS]))
    verify_blocks(kv_tensors(local.cache), PAIRS, checksums)

    local.cache.tensor[2].view(-1).view(torch.uint8)[17] ^= 0x40  # one bit of block 2

    with pytest.raises(KVTransferError, match=r"1 of 4 blocks differ.*\[\(2, 6\)\]") as caught:
        verify_blocks(kv_tensors(local.cache), PAIRS, checksums)
    assert caught.value.reason == "checksum"


def test_two_pairs_run_at_once_on_ports_of_their_own(start_peer, make_local) -> None:
    peers = [start_peer(seed=seed) for seed in (1, 2)]
    pairs = [make_local(engine_id=f"local-{index}") for index in range(2)]
    remotes = [local.handshake(peer) for local, peer in zip(pairs, peers, strict=True)]
    errors: list[BaseException] = []

    def read(local: Local, remote: EngineDescriptor) -> None:
        try:
            local.transport.read_blocks(remote, PAIRS)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=read, args=(local, remote))
               for local, remote in zip(pairs, remotes, strict=True)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)

    assert not errors
    ports = [peer.rpc_port for peer in peers] + [local.transport.rpc_port for local in pairs]
    assert len(set(ports)) == 4 and all(port > 0 for port in ports)
    assert peers[0].endpoint != peers[1].endpoint
    for local, seed in zip(pairs, (1, 2), strict=True):
        assert_blocks_equal(local.cache, filled_cache(FLOAT32, NUM_BLOCKS, seed), PAIRS)


def test_bad_block_ids_and_a_closed_transport_are_refused_before_any_transfer(make_local) -> None:
    local = make_local()
    itself = local.descriptor  # never reached: every call below is refused first

    with pytest.raises(ValueError, match="null block"):
        local.transport.read_blocks(itself, [(0, 3)])
    with pytest.raises(ValueError, match="null block"):
        local.transport.write_blocks(itself, [(3, 0)])
    with pytest.raises(ValueError, match="appears twice"):
        local.transport.read_blocks(itself, [(3, 1), (3, 2)])
    with pytest.raises(ValueError, match="outside"):
        local.transport.read_blocks(itself, [(3, NUM_BLOCKS)])
    local.transport.close()
    with pytest.raises(KVTransferError, match="closed") as caught:
        local.transport.read_blocks(itself, [(3, 1)])
    assert caught.value.reason == "closed"


def test_a_port_mooncake_would_not_use_is_refused() -> None:
    """Mooncake's P2P handshake picks its own RPC port and ignores the one asked for."""
    with pytest.raises(ValueError, match="picks its own port"):
        MooncakeTransport(MooncakeConfig(port=free_port()))

"""`MooncakeConnector`: KV handed over between processes or machines through the Mooncake
transfer engine (`MooncakeTransport`, TCP or RDMA), with the lease traffic on the ZMQ side
channel (`side_channel`).

Each engine starts one transfer engine with its KV tensors registered. A producer also serves
the side channel at `kv_ip`:`kv_port` (0: a free port) and names that address in every
handover, so a consumer needs no configuration: its first load from a producer handshakes
(descriptors compared: model, KV layout, kvpool version) and keeps the link for the next.
Registered KV is readable by any peer that reaches the transfer engine's port: keep `kv_ip`
on a private network (loopback by default).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvpool.engine.kv_connector.config import KVTransferConfig
from kvpool.engine.kv_connector.handshake import EngineDescriptor
from kvpool.engine.kv_connector.mooncake_transport import MooncakeConfig, MooncakeTransport
from kvpool.engine.kv_connector.params import RemotePrefill
from kvpool.engine.kv_connector.pool_connector import PoolKVConnector
from kvpool.engine.kv_connector.regions import kv_tensors
from kvpool.engine.kv_connector.side_channel import (
    SideChannelServer,
    check_lease,
    fetch_checksums,
    handshake,
    release_lease,
)
from kvpool.memory.kv_memory import KVMemory

SIDE_CHANNEL_TIMEOUT_SECONDS = 5.0  # a producer that does not answer this fast is gone


class MooncakeConnector(PoolKVConnector):
    def __init__(self, config: KVTransferConfig, memory: KVMemory, model: str) -> None:
        extra = config.kv_connector_extra_config
        self.transport = MooncakeTransport(MooncakeConfig(
            host=config.kv_ip, protocol=extra["protocol"], device_name=extra["device_name"],
            timeout_seconds=config.transfer_timeout_seconds))
        self.transport.register(kv_tensors(memory.kv_cache))
        self._links: dict[tuple[str, str], MooncakeLink] = {}
        self._links_lock = threading.Lock()
        self.side_channel: SideChannelServer | None = None
        super().__init__(config, memory, model)

    @property
    def local_descriptor(self) -> EngineDescriptor:
        return self.descriptor(self.transport.host, self.transport.rpc_port)

    def _serve(self) -> tuple[str, int]:
        self.side_channel = SideChannelServer(self.local_descriptor, self.producer,
                                              self.config.kv_ip, self.config.kv_port)
        return self.config.kv_ip, int(self.side_channel.endpoint.rsplit(":", 1)[1])

    def _link_for(self, remote: RemotePrefill) -> MooncakeLink:
        host = f"[{remote.host}]" if ":" in remote.host else remote.host
        endpoint = f"tcp://{host}:{remote.port}"
        key = (remote.engine_id, endpoint)
        with self._links_lock:
            link = self._links.get(key)
        if link is None:
            timeout = min(SIDE_CHANNEL_TIMEOUT_SECONDS, self.config.transfer_timeout_seconds)
            peer = handshake(endpoint, self.local_descriptor, timeout)
            link = MooncakeLink(self.transport, peer, endpoint, timeout)
            with self._links_lock:
                self._links[key] = link
        return link

    def _is_quiet(self) -> bool:
        return self.transport.num_abandoned == 0

    def close(self) -> None:
        if self.side_channel is not None:
            self.side_channel.close()
        super().close()
        self.transport.close()


class MooncakeLink:
    """A consumer's link to one producer: reads through the transfer engine, the lease
    traffic on the producer's side channel (`consumer.PeerLink`)."""

    def __init__(self, transport: MooncakeTransport, peer: EngineDescriptor, endpoint: str,
                 timeout_seconds: float) -> None:
        self._transport = transport
        self._peer = peer
        self._endpoint = endpoint
        self._timeout = timeout_seconds

    def check(self, lease_id: str, prompt_digest: str,
              pairs: Sequence[tuple[int, int]]) -> None:
        check_lease(self._endpoint, lease_id, prompt_digest, pairs, self._timeout)

    def read(self, pairs: Sequence[tuple[int, int]]) -> None:
        self._transport.read_blocks(self._peer, pairs)

    def checksums(self, lease_id: str, prompt_digest: str,
                  pairs: Sequence[tuple[int, int]]) -> list[int]:
        return fetch_checksums(self._endpoint, lease_id, prompt_digest, pairs, self._timeout)

    def release(self, lease_id: str) -> None:
        release_lease(self._endpoint, lease_id, self._timeout)

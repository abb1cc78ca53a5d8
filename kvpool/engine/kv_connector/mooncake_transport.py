"""`MooncakeTransport`: one Mooncake transfer engine that moves whole KV blocks between this
process's registered KV tensors and a peer's.

    this engine                                       peer engine
    MooncakeTransport(MooncakeConfig(host))           (the same, in its process)
    register(kv_tensors(cache)) ─ regions ─┐          its regions, in its EngineDescriptor
    describe(engine_id, model, layout) ────┴─ side channel: handshake ─▶ remote descriptor
    read_blocks(remote, [(local id, remote id), ...])
        └─ one batch_transfer_sync_read(remote.session_name, local addresses,
                                         remote addresses, lengths), under a deadline

Each (local, remote) pair moves one block's bytes from every region (`regions.block_ranges`;
runs of consecutive ids go as one range). Only the plain, single-group KV cache layout is
supported (`regions`).

What this relies on in Mooncake 0.3.13 (the `mooncake-transfer-engine-non-cuda` wheel):
- "P2PHANDSHAKE" needs no metadata server: a peer is named "host:rpc_port" (its session name)
  and its segment is fetched from it on the first transfer.
- The RPC port is always Mooncake's choice (a free one it keeps bound); the port in
  `local_hostname` is ignored, so asking for a specific one fails here rather than silently.
- Transfers return 0 or -1, no reason. The peer refuses a remote range outside its registered
  memory, but the local range is not checked (TCP), so both are checked here first.
- Their own timeout is `MC_TRANSFER_TIMEOUT` seconds (at least 5), read once when the engine
  object is built; the first transfer to a peer has none we control (`bounded_call`).
- There is no close call: the engine stops when the object is dropped.

Invariants: registered tensors stay referenced (alive) until `close`; block 0, the null block,
is never a destination; after `close` every call raises KVTransferError ("closed").
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from kvpool.engine.kv_connector.bounded_call import BoundedCaller
from kvpool.engine.kv_connector.errors import KVTransferError
from kvpool.engine.kv_connector.handshake import EngineDescriptor, session_name
from kvpool.engine.kv_connector.regions import KVRegion, block_ranges, regions_of
from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.kv_layout import KVLayout
from kvpool.optional import require

logger = logging.getLogger(__name__)

P2P_HANDSHAKE = "P2PHANDSHAKE"  # Mooncake's "metadata server" value for peer-to-peer metadata
TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"
MIN_NATIVE_TIMEOUT_SECONDS = 5  # Mooncake raises anything lower to 5
ABANDONED_WAIT_SECONDS = 90.0  # close() waits this long for transfers past their deadline


@dataclass(frozen=True, slots=True)
class MooncakeConfig:
    """Where the transfer engine listens and how long a transfer may take.

    `port` 0 lets Mooncake pick (the only choice its P2P handshake honours); `protocol` is
    Mooncake's ("tcp"; "rdma" where there are RDMA devices); `device_name` filters RDMA
    devices ("" = all)."""

    host: str = "127.0.0.1"
    port: int = 0
    protocol: str = "tcp"
    device_name: str = ""
    timeout_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {self.timeout_seconds}")


class MooncakeTransport:
    """One initialized Mooncake transfer engine, its registered KV regions, and block
    transfers to and from peers described by `EngineDescriptor`s."""

    def __init__(self, config: MooncakeConfig | None = None) -> None:
        self.config = config or MooncakeConfig()
        module = require("mooncake.engine",
                         "the Mooncake KV transport (pip install 'kvpool[mooncake]')")
        self._supports_device_memory = bool(module.SUPPORT_CUDA)
        self._engine: Any = _initialized_engine(module, self.config)
        self.host = self.config.host
        self.rpc_port: int = self._engine.get_rpc_port()
        self._tensors: tuple[torch.Tensor, ...] = ()
        self.regions: tuple[KVRegion, ...] = ()
        self._caller = BoundedCaller(self.config.timeout_seconds)

    @property
    def session_name(self) -> str:
        """What peers name this engine by: "host:rpc_port"."""
        return session_name(self.host, self.rpc_port)

    def register(self, tensors: Sequence[torch.Tensor]) -> tuple[KVRegion, ...]:
        """Register this process's KV tensors (block-major; `regions.kv_tensors(cache)`) so
        peers can read and write their blocks. Once per transport; all or nothing."""
        self._check_open()
        if self.regions:
            raise ValueError("this transport has registered its KV tensors already")
        self._check_devices(tensors)
        regions = regions_of(tensors)
        for index, region in enumerate(regions):
            code = self._engine.register_memory(region.base_address, region.num_bytes)
            if code != 0:
                for done in regions[:index]:
                    self._engine.unregister_memory(done.base_address)
                raise KVTransferError("failed", f"registering {region.num_bytes} bytes at "
                                                f"{region.base_address:#x} returned {code}")
        self._tensors, self.regions = tuple(tensors), regions
        return regions

    def describe(self, engine_id: str, model: str, layout: KVLayout) -> EngineDescriptor:
        """This engine's descriptor for the handshake (after `register`)."""
        if not self.regions:
            raise ValueError("register the KV tensors before describing the engine")
        return EngineDescriptor(engine_id=engine_id, model=model, layout=layout,
                                host=self.host, rpc_port=self.rpc_port, regions=self.regions)

    def read_blocks(self, remote: EngineDescriptor, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy the peer's blocks into ours: for each (local id, remote id), remote → local.
        KVTransferError if the transfer fails or overruns the deadline."""
        self._transfer(remote, pairs, is_read=True)

    def write_blocks(self, remote: EngineDescriptor, pairs: Sequence[tuple[int, int]]) -> None:
        """Copy our blocks into the peer's: for each (local id, remote id), local → remote."""
        self._transfer(remote, pairs, is_read=False)

    @property
    def num_abandoned(self) -> int:
        """Transfers that overran their deadline and are still running (`bounded_call`)."""
        return self._caller.num_abandoned

    def close(self) -> None:
        """Unregister the KV tensors and drop the transfer engine, once every abandoned
        transfer has returned (waiting up to ABANDONED_WAIT_SECONDS; past that the
        registrations are left in place rather than pulled from under a running transfer)."""
        if self._engine is None:
            return
        engine, self._engine = self._engine, None
        if not self._caller.wait_abandoned(ABANDONED_WAIT_SECONDS):
            logger.warning("closing a Mooncake transport with %d transfers still running; its "
                           "KV memory stays registered", self._caller.num_abandoned)
            return
        for region in self.regions:
            engine.unregister_memory(region.base_address)
        self._tensors, self.regions = (), ()

    def __enter__(self) -> MooncakeTransport:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _transfer(self, remote: EngineDescriptor, pairs: Sequence[tuple[int, int]],
                  is_read: bool) -> None:
        self._check_open()
        if not pairs:
            return
        if not self.regions:
            raise ValueError("register the KV tensors before transferring blocks")
        _check_destinations([pair[0] if is_read else pair[1] for pair in pairs])
        ranges = block_ranges(self.regions, remote.regions, pairs)
        local, peer, lengths = (list(column) for column in zip(*ranges, strict=True))
        engine = self._engine
        call = engine.batch_transfer_sync_read if is_read else engine.batch_transfer_sync_write
        what = (f"{'read' if is_read else 'write'} of {len(pairs)} blocks "
                f"({sum(lengths)} bytes) {'from' if is_read else 'to'} {remote.session_name}")
        code = self._caller.call(what, call, remote.session_name, local, peer, lengths)
        if code != 0:
            raise KVTransferError("failed", f"{what} returned {code} (peer gone, memory not "
                                            f"registered there, or I/O error)")

    def _check_open(self) -> None:
        if self._engine is None:
            raise KVTransferError("closed", "this Mooncake transport is closed")

    def _check_devices(self, tensors: Sequence[torch.Tensor]) -> None:
        on_device = [str(t.device) for t in tensors if t.device.type != "cpu"]
        if on_device and not self._supports_device_memory:
            raise ValueError(f"this Mooncake build moves host memory only; got tensors on "
                             f"{on_device} (install a CUDA build of mooncake-transfer-engine)")


def _check_destinations(block_ids: list[int]) -> None:
    """ValueError if a transfer would write the null block, or one block twice."""
    if NULL_BLOCK_ID in block_ids:
        raise ValueError(f"block {NULL_BLOCK_ID} is the null block and is never written")
    if len(set(block_ids)) != len(block_ids):
        raise ValueError(f"a destination block appears twice in {block_ids}")


def _initialized_engine(module: ModuleType, config: MooncakeConfig) -> Any:
    """A TransferEngine listening on config.host, its transfers bounded by the config's
    timeout; KVTransferError if it cannot start, ValueError if it would not take the asked
    port."""
    seconds = max(MIN_NATIVE_TIMEOUT_SECONDS, math.ceil(config.timeout_seconds))
    previous = os.environ.get(TIMEOUT_ENV)
    os.environ[TIMEOUT_ENV] = str(seconds)  # read once, by the constructor
    try:
        engine = module.TransferEngine()
    finally:
        if previous is None:
            del os.environ[TIMEOUT_ENV]
        else:
            os.environ[TIMEOUT_ENV] = previous
    local_hostname = session_name(config.host, config.port) if config.port else config.host
    code = engine.initialize(local_hostname, P2P_HANDSHAKE, config.protocol, config.device_name)
    if code != 0:
        raise KVTransferError("failed", f"Mooncake could not start on {local_hostname} over "
                                        f"{config.protocol} (initialize returned {code})")
    if config.port and engine.get_rpc_port() != config.port:
        raise ValueError(f"Mooncake chose RPC port {engine.get_rpc_port()}, not the "
                         f"{config.port} asked for: its P2P handshake picks its own port; "
                         f"pass port 0 and publish the port it reports")
    return engine

"""What two engines exchange before any KV transfer, and the rule that admits a peer.

An `EngineDescriptor` says who an engine is (id, kvpool version, model), how its KV is cut
into blocks (the `KVLayout`: dtype, block size, layers, KV heads, head dim, hence bytes per
block), where its transfer engine listens (host, RPC port, hence Mooncake's session name) and
where its registered KV regions start. `check_compatible` refuses a peer whose blocks would
not mean the same as ours, naming the first fact that differs; only then may one engine read
or write the other's blocks at the addresses its descriptor gives.

On the wire (`to_wire` / `from_wire`, plain JSON types, carried by
`kvpool.engine.kv_connector.side_channel`) the layout travels with its bytes per block and the
transport with its session name, so a peer whose formulas differ from ours is caught even when
every plain field agrees.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvpool import __version__
from kvpool.engine.kv_connector.errors import IncompatibleKVError
from kvpool.engine.kv_connector.regions import KVRegion, region_block_bytes
from kvpool.memory.kv_layout import KVLayout


def session_name(host: str, rpc_port: int) -> str:
    """Mooncake's name for the transfer engine at host:port (an IPv6 host in brackets): what
    a peer passes as `target_hostname`."""
    return f"[{host}]:{rpc_port}" if ":" in host else f"{host}:{rpc_port}"


@dataclass(frozen=True, slots=True)
class EngineDescriptor:
    """One engine as its peers see it. `regions` are in `kv_tensors` order (codes, then scales
    when the KV dtype is quantized), each block `layout`'s size for that region."""

    engine_id: str
    model: str
    layout: KVLayout
    host: str
    rpc_port: int
    regions: tuple[KVRegion, ...]
    kvpool_version: str = __version__

    def __post_init__(self) -> None:
        expected = region_block_bytes(self.layout)
        actual = tuple(region.bytes_per_block for region in self.regions)
        if actual != expected:
            raise ValueError(f"regions of {actual} bytes per block do not hold the layout "
                             f"{self.layout}, which needs {expected}")

    @property
    def session_name(self) -> str:
        return session_name(self.host, self.rpc_port)

    @property
    def num_blocks(self) -> int:
        return self.regions[0].num_blocks

    def to_wire(self) -> dict[str, Any]:
        layout = self.layout
        return {
            "engine_id": self.engine_id,
            "kvpool_version": self.kvpool_version,
            "model": self.model,
            "kv_layout": {"dtype": layout.dtype, "block_size": layout.block_size,
                          "num_layers": layout.num_layers, "num_kv_heads": layout.num_kv_heads,
                          "head_dim": layout.head_dim, "bytes_per_block": layout.bytes_per_block},
            "transport": {"host": self.host, "rpc_port": self.rpc_port,
                          "session_name": self.session_name},
            "regions": [{"base_address": r.base_address, "num_bytes": r.num_bytes,
                         "bytes_per_block": r.bytes_per_block} for r in self.regions],
        }

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> EngineDescriptor:
        """The descriptor `to_wire` gave; IncompatibleKVError if the sender's bytes per block
        or session name are not what this version computes from its fields, KeyError or
        TypeError or ValueError if `wire` is malformed."""
        fields = dict(wire["kv_layout"])
        claimed_bytes = fields.pop("bytes_per_block")
        layout = KVLayout(**fields)
        if claimed_bytes != layout.bytes_per_block:
            raise IncompatibleKVError("bytes_per_block of the same layout", layout.bytes_per_block,
                                      claimed_bytes)
        transport = wire["transport"]
        descriptor = cls(engine_id=wire["engine_id"], model=wire["model"], layout=layout,
                         host=transport["host"], rpc_port=transport["rpc_port"],
                         regions=tuple(KVRegion(**region) for region in wire["regions"]),
                         kvpool_version=wire["kvpool_version"])
        if transport["session_name"] != descriptor.session_name:
            raise IncompatibleKVError("session name of the same host and port",
                                      descriptor.session_name, transport["session_name"])
        return descriptor


# What must agree, in the order a mismatch is reported.
_MUST_AGREE: tuple[tuple[str, Callable[[EngineDescriptor], object]], ...] = (
    ("model", lambda d: d.model),
    ("block_size", lambda d: d.layout.block_size),
    ("kv_dtype", lambda d: d.layout.dtype),
    ("num_kv_heads", lambda d: d.layout.num_kv_heads),
    ("head_dim", lambda d: d.layout.head_dim),
    ("num_layers", lambda d: d.layout.num_layers),
    ("kvpool_version", lambda d: d.kvpool_version),
)


def check_compatible(local: EngineDescriptor, remote: EngineDescriptor) -> None:
    """IncompatibleKVError naming the first of model, block size, KV dtype, KV heads, head dim,
    layers and kvpool version on which `remote` differs from `local`."""
    for field, read in _MUST_AGREE:
        if read(local) != read(remote):
            raise IncompatibleKVError(field, read(local), read(remote))

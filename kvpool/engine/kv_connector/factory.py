"""The engine's KV connector, from its `kv_transfer_config` (none: `NoKVConnector`)."""

from __future__ import annotations

from kvpool.engine.kv_connector.base import KVConnectorBase, NoKVConnector
from kvpool.engine.kv_connector.config import KVTransferConfig
from kvpool.memory.kv_memory import KVMemory


def make_kv_connector(config: KVTransferConfig | None, memory: object,
                      model: str) -> KVConnectorBase:
    """The connector `config` names over `memory`; ValueError for KV memory it cannot move
    (a hybrid model's several groups: the transport registers one plain KV tensor)."""
    if config is None:
        return NoKVConnector()
    if not isinstance(memory, KVMemory):
        raise ValueError("kv_transfer_config supports models with one KV cache group; this "
                         "model's sliding-window and full-attention layers keep several")
    if config.kv_connector == "LoopbackConnector":
        from kvpool.engine.kv_connector.loopback import LoopbackConnector

        return LoopbackConnector(config, memory, model)
    # Mooncake is optional (`kvpool[mooncake]`): imported only when named.
    from kvpool.engine.kv_connector.mooncake_connector import MooncakeConnector

    return MooncakeConnector(config, memory, model)

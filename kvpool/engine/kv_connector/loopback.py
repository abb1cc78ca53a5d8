"""`LoopbackConnector`: engines in one process hand KV over by tensor copies.

For tests and single-process experiments: a producer registers itself under its engine id in
this process (weakly: a collected engine is gone), and a consumer's link reads the producer's
KV tensors directly and asks its `KVProducer` what the side channel would ask over ZMQ. Every
rule of the handover holds as with `MooncakeConnector`: the handshake, the lease check before
the read, the checksums under the live lease after it, the release.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence

import torch

from kvpool.engine.kv_connector.errors import KVTransferError
from kvpool.engine.kv_connector.handshake import check_compatible
from kvpool.engine.kv_connector.params import RemotePrefill
from kvpool.engine.kv_connector.pool_connector import PoolKVConnector

IN_PROCESS = ("in-process", 0)  # the (host, port) a loopback handover names

_producers: weakref.WeakValueDictionary[str, LoopbackConnector] = weakref.WeakValueDictionary()


class LoopbackConnector(PoolKVConnector):
    def _serve(self) -> tuple[str, int]:
        _producers[self.config.engine_id] = self
        return IN_PROCESS

    def _link_for(self, remote: RemotePrefill) -> LoopbackLink:
        producer = _producers.get(remote.engine_id)
        if producer is None or producer.producer is None:
            raise KVTransferError("failed", f"no producer {remote.engine_id!r} in this process")
        check_compatible(self.descriptor(*IN_PROCESS), producer.descriptor(*IN_PROCESS))
        return LoopbackLink(self.tensors, producer)

    def close(self) -> None:
        if _producers.get(self.config.engine_id) is self:
            del _producers[self.config.engine_id]
        super().close()


class LoopbackLink:
    """A consumer's link to a producer in this process (`consumer.PeerLink`)."""

    def __init__(self, local: Sequence[torch.Tensor], remote: LoopbackConnector) -> None:
        self._local = tuple(local)
        self._remote = remote

    def check(self, lease_id: str, prompt_digest: str,
              pairs: Sequence[tuple[int, int]]) -> None:
        self._remote.producer.check(lease_id, prompt_digest, pairs, time.monotonic())

    def read(self, pairs: Sequence[tuple[int, int]]) -> None:
        local_ids = torch.tensor([local for local, _ in pairs])
        remote_ids = torch.tensor([remote for _, remote in pairs])
        for local, remote in zip(self._local, self._remote.tensors, strict=True):
            local[local_ids.to(local.device)] = remote[remote_ids.to(remote.device)].to(
                local.device)

    def checksums(self, lease_id: str, prompt_digest: str,
                  pairs: Sequence[tuple[int, int]]) -> list[int]:
        return self._remote.producer.checksums(lease_id, prompt_digest, pairs,
                                               time.monotonic())

    def release(self, lease_id: str) -> None:
        self._remote.producer.release_later(lease_id)

"""`PoolKVConnector`: the KV connector over kvpool's block pool, producer and consumer halves
in one object, whatever carries the bytes.

A producer (`kv_producer`, `kv_both`) answers a `do_remote_decode` request, once it ends, by
leasing its prompt's full blocks before the last token, found in the prefix cache under the
request's block hashes (`KVProducer`), and returning the handover (`RemotePrefill.to_wire`) as
the output's kv_transfer_params. A consumer (`kv_consumer`, `kv_both`) loads a
`do_remote_prefill` request's blocks before scheduling it (`KVConsumer`). Subclasses say how a
producer is reached (`_serve`: expose the producer, return where readers reach it) and how a
consumer reaches one (`_link_for`).

Both halves need the prefix cache (the producer finds a finished prompt's blocks there; the
consumer publishes loaded blocks into it) and the plain single-group, static KV pool (the
transport registers one fixed set of tensors: `regions`); `EngineConfig` and `factory` refuse
others.
"""

from __future__ import annotations

import dataclasses
import secrets
from abc import abstractmethod
from typing import Any

import torch

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.kv_connector import params
from kvpool.engine.kv_connector.base import KVConnectorBase
from kvpool.engine.kv_connector.config import KVTransferConfig
from kvpool.engine.kv_connector.consumer import KVConsumer, Loaded, PeerLink
from kvpool.engine.kv_connector.errors import FAILURE_REASONS
from kvpool.engine.kv_connector.handshake import EngineDescriptor
from kvpool.engine.kv_connector.params import RemoteDecode, RemotePrefill, token_digest
from kvpool.engine.kv_connector.producer import KVProducer
from kvpool.engine.kv_connector.regions import kv_tensors, regions_of
from kvpool.engine.kv_connector.stats import KVTransferStats
from kvpool.engine.sequence import Request
from kvpool.memory.kv_memory import KVMemory


class PoolKVConnector(KVConnectorBase):
    """Producer and/or consumer (by `config.kv_role`) over `memory` (module docstring)."""

    def __init__(self, config: KVTransferConfig, memory: KVMemory, model: str) -> None:
        self.config = config
        self.memory = memory
        self.tensors: tuple[torch.Tensor, ...] = kv_tensors(memory.kv_cache)
        self.model = model
        self.producer = (KVProducer(memory.pool, self.tensors, config.lease_seconds)
                         if config.is_producer else None)
        self.consumer = (KVConsumer(memory, self.tensors, self._link_for,
                                    config.transfer_timeout_seconds, self._is_quiet)
                         if config.is_consumer else None)
        self.host, self.port = self._serve() if self.producer is not None else ("", 0)

    def descriptor(self, host: str, rpc_port: int) -> EngineDescriptor:
        """This engine as its peers see it (for the handshake)."""
        return EngineDescriptor(engine_id=self.config.engine_id, model=self.model,
                                layout=self.memory.layout, host=host, rpc_port=rpc_port,
                                regions=regions_of(self.tensors))

    # ------------------------------------------------------------ the two sides
    def accept(self, request: Request) -> None:
        transfer = params.parse((request.params.extra_args or {}).get(params.PARAM))
        if isinstance(transfer, RemoteDecode) and self.producer is None:
            raise InvalidRequestError("do_remote_decode: this engine is a kv_consumer; send "
                                      "prefill requests to a kv_producer", params.PARAM)
        if isinstance(transfer, RemotePrefill) and self.consumer is None:
            raise InvalidRequestError("do_remote_prefill: this engine is a kv_producer; send "
                                      "decode requests to a kv_consumer", params.PARAM)
        request.kv_transfer = transfer

    def start_load_kv(self, request: Request, block_hashes: list, now: float) -> bool:
        if not isinstance(request.kv_transfer, RemotePrefill):
            return False
        return self.consumer.start(request, block_hashes, request.kv_transfer, now)

    def get_finished(self, now: float) -> list[Loaded]:
        """Loaded requests; a failed load keeps its error only where kv_load_failure_policy
        is "fail" (a load that found no room is computed here, whatever the policy: it waits
        for room like any request)."""
        if self.consumer is None:
            return []
        fails = self.config.kv_load_failure_policy == "fail"
        return [loaded if loaded.error is None or (fails and loaded.error.reason != "no_room")
                else dataclasses.replace(loaded, error=None)
                for loaded in self.consumer.collect(now)]

    def wait_for_load(self, timeout: float) -> None:
        if self.consumer is not None:
            self.consumer.wait(timeout)

    def request_finished(self, request: Request, now: float) -> dict[str, Any] | None:
        if self.consumer is not None:
            self.consumer.finish(request.request_id)
        if not isinstance(request.kv_transfer, RemoteDecode):
            return None
        prompt = request.prompt_token_ids
        size = self.memory.layout.block_size
        num_blocks = (len(prompt) - 1) // size
        match = self.memory.match_prefix(request.sequences[0].block_hashes[:num_blocks],
                                         prompt[: num_blocks * size])
        if not match.block_ids:  # shorter than a block, or (rarely) evicted already
            return None
        # The lease id is the reader's capability: unguessable, so no request names another's.
        lease_id = secrets.token_urlsafe(16)
        digest = token_digest(prompt)
        lease = self.producer.hand_over(lease_id, match.block_ids, digest, now)
        return RemotePrefill(
            engine_id=self.config.engine_id, host=self.host, port=self.port,
            lease_id=lease_id, block_ids=tuple(lease.block_ids),
            generations=tuple(lease.generations.values()), num_tokens=len(prompt),
            token_digest=digest).to_wire()

    def abort(self, request_id: str) -> None:
        if self.consumer is not None:
            self.consumer.abort(request_id)

    def tick(self, now: float) -> None:
        if self.producer is not None:
            self.producer.tick(now)

    @property
    def num_pending(self) -> int:
        return 0 if self.consumer is None else self.consumer.num_pending

    def stats(self) -> KVTransferStats:
        fields: dict[str, Any] = {"role": self.config.kv_role}
        if self.producer is not None:
            leases = self.producer.stats()
            fields |= {"num_sent_blocks": self.producer.num_sent_blocks,
                       "num_sent_bytes": self.producer.num_sent_bytes,
                       "num_leases": leases.num_leases,
                       "num_leased_blocks": leases.num_leased_blocks,
                       "num_leases_granted": leases.num_granted,
                       "num_leases_released": leases.num_released,
                       "num_leases_expired": leases.num_expired}
        if self.consumer is not None:
            received = self.consumer.stats
            fields |= {"num_received_blocks": received.num_blocks,
                       "num_received_bytes": received.num_bytes,
                       "failures": tuple((reason, received.failures[reason])
                                         for reason in FAILURE_REASONS),
                       "num_loading": self.consumer.num_loading,
                       "load_seconds_counts": tuple(received.seconds.counts),
                       "load_seconds_sum": received.seconds.total}
        return KVTransferStats(**fields)

    @property
    def num_held_blocks(self) -> int:
        return len(self.leased_block_ids())  # distinct blocks: holds may share one

    def leased_block_ids(self) -> dict[int, int]:
        """Block id -> references held for transfers (for the snapshot): a producer's live
        leases, and a consumer's loads (in flight, given up mid-transfer, or loaded and
        held until their request ends)."""
        held: dict[int, int] = {}
        block_ids = [] if self.consumer is None else self.consumer.held_block_ids()
        if self.producer is not None:
            block_ids += [b for lease in self.producer.live_leases() for b in lease.block_ids]
        for block_id in block_ids:
            held[block_id] = held.get(block_id, 0) + 1
        return held

    def close(self) -> None:
        if self.consumer is not None:
            self.consumer.close()
        if self.producer is not None:
            self.producer.release_all()

    # ------------------------------------------------------------ transports
    @abstractmethod
    def _serve(self) -> tuple[str, int]:
        """Expose the producer to readers; (host, port) a handover names."""

    @abstractmethod
    def _link_for(self, remote: RemotePrefill) -> PeerLink:
        """A link to the producer `remote` names, handshake done (IncompatibleKVError,
        KVTransferError)."""

    def _is_quiet(self) -> bool:
        """No transfer of ours is still running past its deadline."""
        return True


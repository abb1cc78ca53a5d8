"""The KV connector interface the engine drives, shaped like vLLM's KVConnector V1 so its
concepts carry over, and the engine's connector when none is configured.

vLLM's connector has a scheduler side and a worker side; kvpool's engine runs both in one
process, on its step thread, and the split shows in which methods read the pool's bookkeeping
and which move bytes:

    vLLM (KVConnectorBase_V1)                  here
    get_num_new_matched_tokens +               start_load_kv(request, hashes, now): False when
      update_state_after_alloc +                 nothing is loaded (the request is scheduled at
      build_connector_meta + start_load_kv       once); else the load runs on a worker thread
    wait_for_layer_load / wait_for_save        wait_for_load(timeout): a block holds every
                                                 layer, so the unit of waiting is a whole load
    get_finished (finished recving)            get_finished(now): loaded requests, to schedule
    get_block_ids_with_load_errors             the same list, each with its error, handled by
                                                 kv_load_failure_policy
    request_finished -> (delay_free, params)   request_finished(request, now) -> params: the
                                                 blocks are leased (`kvpool.memory.block_leases`)
                                                 rather than kept from being freed
    get_finished (finished sending)            tick(now): readers' releases and expiries end
                                                 leases, whose blocks go back
    register_kv_caches                         done when the connector is built

Producers do not save or push anything (no `save_kv_layer`): readers pull the leased blocks in
place. `accept` runs first, when a request is made: it reads the request's `kv_transfer_params`
(`kvpool.engine.kv_connector.params`) and refuses those this engine's role cannot honour.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.kv_connector import params
from kvpool.engine.kv_connector.consumer import Loaded
from kvpool.engine.kv_connector.stats import KVTransferStats
from kvpool.engine.sequence import Request


class KVConnectorBase(ABC):
    """What the engine calls, at the points its docstring names (module docstring)."""

    @abstractmethod
    def accept(self, request: Request) -> None:
        """Read `request.params`' kv_transfer_params into `request.kv_transfer`;
        InvalidRequestError for params this engine cannot honour."""

    @abstractmethod
    def start_load_kv(self, request: Request, block_hashes: list, now: float) -> bool:
        """Begin loading an accepted request's KV from elsewhere; False: schedule it now."""

    @abstractmethod
    def get_finished(self, now: float) -> list[Loaded]:
        """Requests whose load ended since the last call: each to be scheduled, or (its
        `error` set: kv_load_failure_policy "fail") to end with that error."""

    @abstractmethod
    def wait_for_load(self, timeout: float) -> None:
        """Block until some load ends, or `timeout` seconds."""

    @abstractmethod
    def request_finished(self, request: Request, now: float) -> dict[str, Any] | None:
        """A request ended (not aborted): the kv_transfer_params its output carries."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """A request was aborted wherever it was: forget it, free what it held."""

    @abstractmethod
    def tick(self, now: float) -> None:
        """Once per step, and now and then while idle: end released and expired leases."""

    @property
    @abstractmethod
    def num_pending(self) -> int:
        """Requests loading, or loaded and not yet handed back (they wait, as far as a
        caller counting requests is concerned)."""

    @property
    def has_pending(self) -> bool:
        return self.num_pending > 0

    @abstractmethod
    def stats(self) -> KVTransferStats | None:
        """Transfer counters and leases (None: no connector)."""

    @abstractmethod
    def leased_block_ids(self) -> dict[int, int]:
        """Block id -> references held for transfers, no request's (for the snapshot)."""

    @property
    @abstractmethod
    def num_held_blocks(self) -> int:
        """Blocks held for transfers (`leased_block_ids`, each once): leases, and loads in
        flight, held until their request ends, or given up while their transfer may write."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and loading; leases end."""


class NoKVConnector(KVConnectorBase):
    """An engine without `kv_transfer_config`: KV never moves, and a request asking it to is
    refused by name."""

    def accept(self, request: Request) -> None:
        raw = (request.params.extra_args or {}).get(params.PARAM)
        if params.parse(raw) is not None:
            raise InvalidRequestError(
                "kv_transfer_params needs a server started with --kv-transfer-config "
                "(a kv_producer or kv_consumer)", params.PARAM)

    def start_load_kv(self, request: Request, block_hashes: list, now: float) -> bool:
        return False

    def get_finished(self, now: float) -> list[Loaded]:
        return []

    def wait_for_load(self, timeout: float) -> None:
        return None

    def request_finished(self, request: Request, now: float) -> dict[str, Any] | None:
        return None

    def abort(self, request_id: str) -> None:
        return None

    def tick(self, now: float) -> None:
        return None

    @property
    def num_pending(self) -> int:
        return 0

    def stats(self) -> KVTransferStats | None:
        return None

    def leased_block_ids(self) -> dict[int, int]:
        return {}

    @property
    def num_held_blocks(self) -> int:
        return 0

    def close(self) -> None:
        return None

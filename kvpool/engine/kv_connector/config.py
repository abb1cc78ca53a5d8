"""`kv_transfer_config`: which KV connector an engine runs and in which role (vLLM's option).

The same JSON object vLLM takes (`--kv-transfer-config '{"kv_connector": "MooncakeConnector",
"kv_role": "kv_producer"}'`, or `LLM(kv_transfer_config={...})`), with the fields kvpool honours:

- `kv_connector`: "MooncakeConnector" (blocks move through the Mooncake transfer engine, TCP
  or RDMA, between processes or machines) or "LoopbackConnector" (engines in one process; for
  tests and single-process experiments);
- `kv_role`: "kv_producer" (a prefill worker: it computes prompts and leases their blocks to
  a reader), "kv_consumer" (a decode worker: it loads a prompt's blocks from the producer
  named in the request's `kv_transfer_params`), or "kv_both";
- `engine_id`: how peers name this engine (default: a fresh uuid);
- `kv_ip`: the address this engine's side channel and transfer engine listen on and
  advertise (default loopback); `kv_port`: the side channel's port (default: a free one,
  announced in every handover, so nothing needs configuring on one machine);
- `kv_load_failure_policy`: what a consumer does when a load fails or times out:
  "recompute" (the default: it computes the prompt itself, same output) or "fail" (the
  request ends with an error naming the failure);
- `kv_connector_extra_config`, kvpool's knobs: `lease_seconds` (how long a producer holds a
  handed-over prompt's blocks for its reader; default 60), `transfer_timeout_seconds` (one
  load's deadline, default 30), `protocol` (Mooncake's "tcp" or "rdma"), `device_name`
  (RDMA devices, "" = all).

vLLM's buffer fields (`kv_buffer_device`, `kv_buffer_size`) describe buffers kvpool does not
have and are accepted and ignored; `kv_rank`, `kv_parallel_size` and `kv_connector_module_path`
are accepted only unset (their default).

Invariants: a built config names a known connector and role, a policy, positive finite
timeouts, and a port in 0..65535 (0: a free one).
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, field, fields
from typing import Any

from kvpool.engine.json_options import check_known, drop_unsupported, option_fields

CONNECTORS = ("MooncakeConnector", "LoopbackConnector")
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("recompute", "fail")
_IGNORED = ("kv_buffer_device", "kv_buffer_size")  # vLLM's buffers: nothing to configure here
_UNSET_ONLY = {"kv_rank": None, "kv_parallel_size": 1, "kv_connector_module_path": None}
_EXTRA_DEFAULTS: dict[str, Any] = {"lease_seconds": 60.0, "transfer_timeout_seconds": 30.0,
                                   "protocol": "tcp", "device_name": ""}


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """One engine's KV connector settings (module docstring)."""

    kv_connector: str
    kv_role: str
    engine_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    kv_ip: str = "127.0.0.1"
    kv_port: int = 0
    kv_load_failure_policy: str = "recompute"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _one_of("kv_connector", self.kv_connector, CONNECTORS)
        _one_of("kv_role", self.kv_role, ROLES)
        _one_of("kv_load_failure_policy", self.kv_load_failure_policy, FAILURE_POLICIES)
        if not isinstance(self.engine_id, str) or not self.engine_id:
            raise ValueError("kv_transfer_config: engine_id must be a non-empty string")
        if not isinstance(self.kv_ip, str) or not self.kv_ip:
            raise ValueError("kv_transfer_config: kv_ip must be a host address")
        if isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int) or not (
                0 <= self.kv_port <= 65535):
            raise ValueError(f"kv_transfer_config: kv_port must be in 0..65535 (0: a free "
                             f"port), got {self.kv_port!r}")
        extra = dict(self.kv_connector_extra_config or {})
        unknown = sorted(set(extra) - set(_EXTRA_DEFAULTS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown kv_connector_extra_config keys "
                             f"{unknown} (known: {sorted(_EXTRA_DEFAULTS)})")
        for name in ("lease_seconds", "transfer_timeout_seconds"):
            value = extra.get(name, _EXTRA_DEFAULTS[name])
            if isinstance(value, bool) or not isinstance(value, int | float) or not (
                    value > 0 and math.isfinite(value)):
                raise ValueError(f"kv_transfer_config: {name} must be a positive number of "
                                 f"seconds, got {value!r}")
        object.__setattr__(self, "kv_connector_extra_config", {**_EXTRA_DEFAULTS, **extra})

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def lease_seconds(self) -> float:
        return float(self.kv_connector_extra_config["lease_seconds"])

    @property
    def transfer_timeout_seconds(self) -> float:
        return float(self.kv_connector_extra_config["transfer_timeout_seconds"])

    @classmethod
    def from_value(cls, value: KVTransferConfig | dict[str, Any] | str | None
                   ) -> KVTransferConfig | None:
        """From a config object, a dict, or its JSON text (the CLI's); None stays None.
        ValueError naming the field for anything kvpool cannot honour."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        options = option_fields("kv_transfer_config", value)
        for name in _IGNORED:
            options.pop(name, None)
        drop_unsupported("kv_transfer_config", options, _UNSET_ONLY,
                         "one engine per connector; leave it unset")
        for name in ("kv_connector", "kv_role"):
            if options.get(name) is None:
                raise ValueError(f"kv_transfer_config: {name} is required (one of "
                                 f"{CONNECTORS if name == 'kv_connector' else ROLES})")
        for name in ("engine_id", "kv_port"):  # vLLM's null: the default
            if options.get(name) is None:
                options.pop(name, None)
        check_known("kv_transfer_config", options, (f.name for f in fields(cls)))
        return cls(**options)


def _one_of(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"kv_transfer_config: {name} must be one of {allowed}, got {value!r}")

"""`kv_events_config`: whether and where an engine publishes its KV events (vLLM's option).

The same JSON object vLLM takes (`--kv-events-config '{"enable_kv_cache_events": true,
"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557"}'`), with the fields kvpool honours:

- `enable_kv_cache_events`: False (the default) publishes nothing and costs nothing;
- `publisher`: "zmq" (a ZMQ PUB socket bound at `endpoint`) or "null" (events are collected
  and numbered, so the snapshot endpoint still works, but sent nowhere);
- `endpoint`: where the PUB socket binds, loopback by default ("tcp://127.0.0.1:5557"); a
  "*" host is reachable on every interface, and consumers connect to it at the replica's own
  host;
- `topic`: the first frame of every message (consumers subscribe by prefix);
- `hwm`: the PUB socket's send high-water mark, in messages: past it ZMQ drops messages for
  a slow subscriber, which then sees a gap in the sequence numbers and resyncs;
- `max_queue_size`: batches waiting for the publisher thread; past it the oldest are dropped
  (the gap tells the consumers, as above).

Privacy (the socket carries every tenant's blocks, while the HTTP routes show them to the admin
key only), kvpool's own fields:

- `include_token_ids`: False (the default) publishes hashes only, each BlockStored with an
  empty `token_ids` (vLLM's consumers accept it; the router needs only hashes); True publishes
  the prompts' tokens too, as vLLM does;
- `allow_public_bind`: a wildcard host ("*", "0.0.0.0", "::") while the server has API keys
  is refused at start-up (`check_exposure`) unless this is True;
- `curve_secret_key_file`: a ZMQ CURVE secret key file (`kvpool.formats.kv_events_curve`):
  the socket then encrypts and takes only subscribers whose public key is listed in
  `curve_client_keys` (Z85 text, or files holding a public key).

vLLM's `replay_endpoint` and `buffer_steps` (a replay socket) must stay unset: a kvpool
consumer that lost events resyncs from the replica's `GET /v1/kv/events/snapshot` instead.
The wire format and the events are `kvpool.formats.kv_events`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kvpool.engine.json_options import check_known, drop_unsupported, option_fields

PUBLISHERS = ("zmq", "null")
DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"
WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]"})
_VLLM_ONLY = {"replay_endpoint": None, "buffer_steps": 10_000}  # accepted at these values only


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = DEFAULT_ENDPOINT
    topic: str = ""
    hwm: int = 100_000
    max_queue_size: int = 100_000
    include_token_ids: bool = False
    allow_public_bind: bool = False
    curve_secret_key_file: str | None = None
    curve_client_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config: enable_kv_cache_events must be true or false")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"kv_events_config: publisher must be one of {PUBLISHERS}, got "
                             f"{self.publisher!r}")
        if self.publisher == "zmq" and "://" not in self.endpoint:
            raise ValueError(f"kv_events_config: endpoint must be a ZMQ address such as "
                             f"tcp://127.0.0.1:5557, got {self.endpoint!r}")
        for name in ("include_token_ids", "allow_public_bind"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kv_events_config: {name} must be true or false")
        if isinstance(self.curve_client_keys, str) or not all(
                isinstance(key, str) and key for key in self.curve_client_keys):
            raise ValueError("kv_events_config: curve_client_keys must be a list of public "
                             "keys (Z85 text or key files)")
        object.__setattr__(self, "curve_client_keys", tuple(self.curve_client_keys))
        if self.curve_client_keys and self.curve_secret_key_file is None:
            raise ValueError("kv_events_config: curve_client_keys needs curve_secret_key_file")
        for name in ("hwm", "max_queue_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv_events_config: {name} must be an integer >= 1, got "
                                 f"{value!r}")

    @property
    def is_enabled(self) -> bool:
        return self.enable_kv_cache_events

    @property
    def is_public_bind(self) -> bool:
        """The PUB socket would listen on every interface (a wildcard host)."""
        address = self.endpoint.partition("://")[2]
        return address.rpartition(":")[0] in WILDCARD_HOSTS

    def check_exposure(self, has_api_keys: bool) -> None:
        """ValueError when a server with API keys would publish every tenant's blocks on
        every interface without the operator opting in (`allow_public_bind`)."""
        if (self.is_enabled and self.publisher == "zmq" and has_api_keys
                and self.is_public_bind and not self.allow_public_bind):
            raise ValueError(
                f"kv_events_config: endpoint {self.endpoint!r} listens on every interface, "
                "and the KV events carry every tenant's block hashes to any subscriber while "
                "the HTTP routes take the admin key; bind a private address (the default is "
                f"{DEFAULT_ENDPOINT}), firewall the port to the routers and set "
                '"allow_public_bind": true, or add "curve_secret_key_file" and set it')

    @classmethod
    def from_value(cls, value: KVEventsConfig | dict[str, Any] | str | None
                   ) -> KVEventsConfig | None:
        """From a config object, a dict, or its JSON text (the CLI's); None stays None.
        ValueError naming the field for anything kvpool cannot honour."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        options = option_fields("kv_events_config", value)
        drop_unsupported("kv_events_config", options, _VLLM_ONLY, "a consumer that lost "
                         "events resyncs from GET /v1/kv/events/snapshot")
        check_known("kv_events_config", options, (field.name for field in fields(cls)))
        return cls(**options)

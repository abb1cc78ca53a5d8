"""`RouterConfig`: everything `kvpool router` needs, validated once.

Keys are the server's (`kvpool.openai.auth`, checked by the server's own middleware with the
same `AccessPolicy`): the same `--api-key` / `--api-key-file` give the same tenants, so the
router derives the cache salt a replica will derive for the same key.
`replica_admin_key` is the replicas' `--admin-api-key`, sent only on the two KV-event calls
(`GET /v1/kv/events` and its snapshot), never on a client's request: a client's own
`Authorization` header is what the replica sees on every forwarded request.
`kv_events_curve_secret_key_file` is the router's CURVE key pair, for replicas whose KV event
socket requires CURVE (`kvpool.formats.kv_events_curve`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from kvpool.openai.auth import ADMIN_TENANT, TenantSalts
from kvpool.openai.middleware import AccessPolicy
from kvpool.router.policy import POLICIES
from kvpool.router.replicas import Role
from kvpool.server.config import ServerConfig

# The server's own default, so that nothing a default replica takes is refused here (read
# off the field: building a ServerConfig would resolve its salt secret at import).
DEFAULT_MAX_REQUEST_BYTES = next(f.default for f in fields(ServerConfig)
                                 if f.name == "max_request_bytes")


@dataclass(frozen=True, slots=True)
class RouterConfig:
    """`replicas`: the replicas' base URLs (`http://host:port`), each once. Or, for
    disaggregated routing instead (`kvpool.router.disagg_forward`), `prefill` and `decode`: the
    prefill workers' and the decode workers' URLs, at least one of each, each URL in one role.

    `max_load_imbalance`: requests in flight a replica may have beyond the least loaded one and
    still be chosen for its prefix (`kvpool.router.policy`).

    Health: every `health_check_interval` seconds each replica's /health is asked (within
    `health_check_timeout`); `num_failures_to_remove` failures in a row take it out, one
    success brings it back. A refused or reset connection on a forwarded request takes it out
    at once.

    Timeouts: `connect_timeout` to reach a replica; `read_timeout` between two bytes of its
    answer (a whole, non-streamed response sends nothing until the end, so this bounds a
    whole generation); None waits for ever.

    `model`: where the tokenizer comes from (the replicas' model; None: the bundled SmolLM2),
    and `chat_template` the replicas' `--chat-template`, if they have one: prompts must be
    tokenized exactly as the replicas tokenize them for the block hashes to agree; for the
    same reason `tenant_salts` must be keyed with the replicas' secret (`--cache-salt-secret-
    file` or `$KVPOOL_CACHE_SALT_SECRET`).
    """

    replicas: tuple[str, ...] = ()
    prefill: tuple[str, ...] = ()
    decode: tuple[str, ...] = ()
    policy: str = "prefix"
    max_load_imbalance: int = 4
    access: AccessPolicy = field(default_factory=AccessPolicy)  # open: no keys
    replica_admin_key: str | None = None
    kv_events_curve_secret_key_file: str | None = None
    health_check_interval: float = 5.0
    health_check_timeout: float = 2.0
    num_failures_to_remove: int = 2
    connect_timeout: float = 5.0
    read_timeout: float | None = 600.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    model: str | None = None
    chat_template: str | None = None
    tenant_salts: TenantSalts = field(default_factory=TenantSalts.resolve, repr=False)

    @property
    def is_disaggregated(self) -> bool:
        return bool(self.prefill)

    @property
    def roles(self) -> dict[str, Role]:
        """Every replica's url -> its role (`kvpool.router.replicas`)."""
        return {**dict.fromkeys(self.replicas, "both"), **dict.fromkeys(self.prefill, "prefill"),
                **dict.fromkeys(self.decode, "decode")}

    def __post_init__(self) -> None:
        self._check_urls()
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {POLICIES}")
        if self.max_load_imbalance < 0 or self.num_failures_to_remove < 1:
            raise ValueError("max_load_imbalance must be >= 0 and num_failures_to_remove >= 1")
        for name in ("health_check_interval", "health_check_timeout", "connect_timeout",
                     "read_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        if any(tenant == ADMIN_TENANT for tenant, _ in self.access.keys.entries):
            raise ValueError(f"tenant name {ADMIN_TENANT!r} is reserved for --admin-api-key")
        if self.access.metrics_keys.is_enabled and self.access.is_metrics_open:
            raise ValueError("give either a metrics API key or allow unauthenticated metrics, "
                             "not both")

    def _check_urls(self) -> None:
        if self.replicas and (self.prefill or self.decode):
            raise ValueError("give either replicas (--replica) or prefill and decode workers "
                             "(--prefill, --decode), not both")
        if bool(self.prefill) != bool(self.decode):
            raise ValueError("disaggregated routing needs at least one prefill worker "
                             "(--prefill URL) and one decode worker (--decode URL)")
        if not (self.replicas or self.prefill):
            raise ValueError("the router needs at least one replica (--replica URL)")
        urls = self.replicas + self.prefill + self.decode
        for url in urls:
            if not url.startswith(("http://", "https://")) or url.endswith("/"):
                raise ValueError(f"replica {url!r}: expected http://host:port, no trailing /")
        if len(set(urls)) != len(urls):
            raise ValueError("each replica may be given only once (and in one role)")

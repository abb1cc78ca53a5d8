"""`ServerConfig`: what the HTTP layer needs beyond the engine: names, keys and input limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.openai.auth import ADMIN_TENANT, ApiKeyTable, TenantSalts
from kvpool.server.cors import CorsConfig

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side options; every limit answers 400 (or 413/429) in OpenAI's error shape.

    `max_concurrent_requests`: generation requests in flight (streams included); one more gets
    429 at once rather than queueing, so a load balancer or the openai client (which retries
    429 with backoff) can go elsewhere or wait. None: no limit.

    `max_queued_sequences`: sequences in flight, summed over those requests (each is its
    prompts × n); a request that would pass it gets 429 the same way, and one that alone asks
    for more gets 400. The concurrency limit alone admits 1,024 requests × 64 prompts = 65,536
    sequences, times n (up to 16). The default, 4096, is four of the largest single request
    (64 prompts × n 16) and 16 times the engine's default `max_num_seqs` (256): enough waiting
    work to keep a full batch busy through many rounds of admission, while a burst past it is
    told to back off instead of sitting minutes in the scheduler's waiting list (with its
    prompts in memory). None: no limit.

    `/metrics` needs a key whenever the other routes do. `metrics_api_keys` (from
    `--metrics-api-key`) are accepted there too, and only there, so Prometheus can scrape
    without a tenant's key; `allow_unauthenticated_metrics` opens /metrics to anyone. The two
    contradict each other, so giving both is an error.

    `admin_api_keys` (from `--admin-api-key`, tenant `ADMIN_TENANT`) open every path a tenant's
    key does, and /metrics; with one, /v1/kv/snapshot lists every tenant's requests (a tenant
    sees only its own). No tenant key may name the admin tenant.

    `tenant_salts`: each tenant's cache salt, keyed by the server's secret (`--cache-salt-
    secret-file`, else `$KVPOOL_CACHE_SALT_SECRET`, else a generated file:
    `kvpool.openai.salt_secret`).
    """

    served_model_names: tuple[str, ...] = (DEFAULT_MODEL_NAME,)
    api_keys: ApiKeyTable = field(default_factory=ApiKeyTable)
    metrics_api_keys: ApiKeyTable = field(default_factory=ApiKeyTable)
    admin_api_keys: ApiKeyTable = field(default_factory=ApiKeyTable)
    allow_unauthenticated_metrics: bool = False
    max_concurrent_requests: int | None = 1024
    max_queued_sequences: int | None = 4096  # prompts × n, summed over requests in flight
    max_request_bytes: int = 4 * 1024 * 1024
    max_n: int = 16  # completions per prompt
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_logprobs: int = 20  # completions `logprobs`, chat `top_logprobs`
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    shutdown_grace_seconds: float = 30.0
    chat_template: str | None = None  # Jinja text replacing the model's (--chat-template)
    tool_call_parser: str = "hermes"  # how tool calls are read from output (--tool-call-parser)
    reasoning_parser: str | None = None  # how thinking is split off (--reasoning-parser)
    tenant_salts: TenantSalts = field(default_factory=TenantSalts.resolve, repr=False)
    cors: CorsConfig = field(default_factory=CorsConfig)  # browsers' cross-origin access
    enable_tokenizer_info_endpoint: bool = False  # GET /tokenizer_info (as vLLM's flag)
    # Input work (tokenizing, chat templates, grammars): threads shared fairly by tenants, and
    # the bounds on a grammar's size and compile time (kvpool.server.input_work).
    input_workers: int = 4
    max_grammar_chars: int = 131_072
    grammar_compile_timeout: float = 1.0  # seconds

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        positive = {
            "max_request_bytes": self.max_request_bytes,
            "max_n": self.max_n,
            "max_prompts": self.max_prompts,
            "max_stop_strings": self.max_stop_strings,
            "max_stop_chars": self.max_stop_chars,
            "input_workers": self.input_workers,
            "max_grammar_chars": self.max_grammar_chars,
        }
        for name in ("max_concurrent_requests", "max_queued_sequences"):
            if getattr(self, name) is not None:
                positive[name] = getattr(self, name)
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if not self.grammar_compile_timeout > 0:
            raise ValueError("grammar_compile_timeout must be > 0")
        if self.max_logprobs < 0 or self.shutdown_grace_seconds < 0:
            raise ValueError("max_logprobs and shutdown_grace_seconds must be >= 0")
        from kvpool.openai.tools import tool_parser_names

        if self.tool_call_parser not in tool_parser_names():
            raise ValueError(f"unknown tool call parser {self.tool_call_parser!r} (known: "
                             f"{', '.join(tool_parser_names())})")
        from kvpool.openai.reasoning import reasoning_parser_names

        if self.reasoning_parser not in (None, *reasoning_parser_names()):
            raise ValueError(f"unknown reasoning parser {self.reasoning_parser!r} (known: "
                             f"{', '.join(reasoning_parser_names())})")
        if any(tenant == ADMIN_TENANT for tenant, _ in self.api_keys.entries):
            raise ValueError(f"tenant name {ADMIN_TENANT!r} is reserved for --admin-api-key")
        if any(tenant != ADMIN_TENANT for tenant, _ in self.admin_api_keys.entries):
            raise ValueError(f"admin_api_keys must all name tenant {ADMIN_TENANT!r}")
        if self.metrics_api_keys.is_enabled and self.allow_unauthenticated_metrics:
            raise ValueError("give either a metrics API key or allow unauthenticated metrics, "
                             "not both")

    @property
    def model_name(self) -> str:
        """The name /v1/models lists first and responses report."""
        return self.served_model_names[0]

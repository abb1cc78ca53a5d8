"""`ServerConfig`: what the HTTP layer needs beyond the engine: names, keys and input limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvpool.server.auth import ApiKeyTable

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """HTTP-side options; every limit answers 400 (or 413/429) in OpenAI's error shape.

    `max_concurrent_requests`: generation requests in flight (streams included); one more gets
    429 at once rather than queueing, so a load balancer or the openai client (which retries
    429 with backoff) can go elsewhere or wait. None: no limit.
    """

    served_model_names: tuple[str, ...] = (DEFAULT_MODEL_NAME,)
    api_keys: ApiKeyTable = field(default_factory=ApiKeyTable)
    max_concurrent_requests: int | None = 1024
    max_request_bytes: int = 4 * 1024 * 1024
    max_n: int = 16  # completions per prompt
    max_prompts: int = 64  # prompts in one /v1/completions batch
    max_logprobs: int = 20  # completions `logprobs`, chat `top_logprobs`
    max_stop_strings: int = 16
    max_stop_chars: int = 256  # per stop string
    shutdown_grace_seconds: float = 30.0

    def __post_init__(self) -> None:
        if not self.served_model_names or not all(self.served_model_names):
            raise ValueError("served_model_names must hold at least one non-empty name")
        positive = {
            "max_request_bytes": self.max_request_bytes,
            "max_n": self.max_n,
            "max_prompts": self.max_prompts,
            "max_stop_strings": self.max_stop_strings,
            "max_stop_chars": self.max_stop_chars,
        }
        if self.max_concurrent_requests is not None:
            positive["max_concurrent_requests"] = self.max_concurrent_requests
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}")
        if self.max_logprobs < 0 or self.shutdown_grace_seconds < 0:
            raise ValueError("max_logprobs and shutdown_grace_seconds must be >= 0")

    @property
    def model_name(self) -> str:
        """The name /v1/models lists first and responses report."""
        return self.served_model_names[0]

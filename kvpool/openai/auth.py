"""API keys, the tenants they name, and the prefix-cache salt derived from a tenant.

Keys come from `--api-key` (tenant "default"; the flag may repeat, and without it the
`KVPOOL_API_KEY` or `VLLM_API_KEY` environment variable gives one) and `--api-key-file`, one
`tenant:key` per line (blank lines and `#` comments skipped). `--metrics-api-key` is a key of
its own tenant, "metrics", that the middleware accepts on /metrics only. `--admin-api-key` is a
key of tenant "admin" (a name no other key may take), accepted on every path a tenant key is and
on /metrics; an admin sees every tenant's requests in KV snapshots. Only SHA-256 digests
of the keys are kept, and a presented key is compared with every digest using
`hmac.compare_digest`, without stopping at a match, so the time taken says nothing about which
key (or how much of one) matched.

Isolation: the salt the engine folds into every block hash is derived here, on the server, from
the authenticated tenant (`TenantSalts`); a client's `cache_salt` can only be appended to it
(narrowing the sharing to requests that give the same salt), never replace it. The salt is
`tenant + NUL + HMAC-SHA256(secret, tenant)` (hex), the secret the server's
(`kvpool.openai.salt_secret`): a tenant name is guessable, its salt is not, so nobody outside
the server can hash a guessed prompt the way another tenant's blocks are hashed. Tenant names
cannot contain NUL, so `salt + NUL + client_salt` is unambiguous: no tenant/salt pair collides
with another, and `tenant_of_salt` reads the tenant back (for the KV snapshot's per-tenant view).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvpool.engine.errors import InvalidRequestError
from kvpool.openai.salt_secret import MIN_SECRET_CHARS, resolve_salt_secret

DEFAULT_TENANT = "default"
METRICS_TENANT = "metrics"  # the tenant of --metrics-api-key (accepted on /metrics only)
ADMIN_TENANT = "admin"  # the tenant of --admin-api-key (every path; sees every tenant)
_SALT_SEPARATOR = "\x00"  # between the tenant and the client's salt; never in a tenant name
MAX_CLIENT_SALT_CHARS = 256


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True, slots=True)
class ApiKeyTable:
    """Tenants and their key digests; empty means authentication is off."""

    entries: tuple[tuple[str, bytes], ...] = ()  # (tenant, sha256(key))

    @classmethod
    def from_keys(cls, tenant_keys: list[tuple[str, str]]) -> ApiKeyTable:
        entries = []
        for tenant, key in tenant_keys:
            _check_tenant(tenant)
            if not key or key != key.strip():
                raise ValueError(f"the key of tenant {tenant!r} is empty or has edge whitespace")
            entries.append((tenant, _digest(key)))
        return cls(tuple(entries))

    @classmethod
    def from_config(
        cls, api_keys: Sequence[str] | str | None = (), api_key_file: str | Path | None = None
    ) -> ApiKeyTable:
        """From `--api-key` (each key names tenant "default"; a lone string is one key, None
        none) and `--api-key-file` (either, both or neither)."""
        keys = [api_keys] if isinstance(api_keys, str) else list(api_keys or ())
        tenant_keys = [(DEFAULT_TENANT, key) for key in keys]
        if api_key_file is not None:
            tenant_keys += parse_key_file(Path(api_key_file).read_text(encoding="utf-8"))
        return cls.from_keys(tenant_keys)

    @property
    def is_enabled(self) -> bool:
        return bool(self.entries)

    def authenticate(self, authorization: str | None, api_key: str | None = None) -> str | None:
        """The tenant named by an `Authorization: Bearer <key>` header or, when there is no
        Authorization header, by an `x-api-key: <key>` header (Anthropic's); else None."""
        key = api_key if authorization is None else _bearer_key(authorization)
        if not key or not key.strip():
            return None
        presented = _digest(key.strip())
        tenant = None
        for entry_tenant, digest in self.entries:  # no early exit: constant work per key
            if hmac.compare_digest(presented, digest):
                tenant = entry_tenant
        return tenant


def _bearer_key(authorization: str) -> str | None:
    scheme, _, key = authorization.partition(" ")
    return key if scheme.lower() == "bearer" else None


def parse_key_file(text: str) -> list[tuple[str, str]]:
    """`tenant:key` lines -> pairs; ValueError naming the line number of a bad line."""
    pairs = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        tenant, separator, key = line.partition(":")
        if not separator or not tenant.strip() or not key.strip():
            raise ValueError(f"api key file line {line_number}: expected 'tenant:key'")
        pairs.append((tenant.strip(), key.strip()))
    return pairs


@dataclass(frozen=True, slots=True)
class TenantSalts:
    """Each tenant's cache salt, keyed by the server's secret (module docstring)."""

    secret: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < MIN_SECRET_CHARS:
            raise ValueError(f"the cache salt secret must be at least {MIN_SECRET_CHARS} bytes")

    @classmethod
    def resolve(cls, secret_file: str | Path | None = None,
                cache_dir: str | Path | None = None) -> TenantSalts:
        """From a flag's file, the environment or the generated file
        (`kvpool.openai.salt_secret.resolve_salt_secret`)."""
        return cls(resolve_salt_secret(secret_file, cache_dir))

    def cache_salt(self, tenant: str, client_salt: str | None) -> str:
        """The engine's cache salt: the tenant's keyed salt, narrowed by the client's salt
        when given.

        InvalidRequestError (param "cache_salt") for a client salt that is too long or is not
        text that can be hashed (a lone surrogate, which JSON's `\\ud800` escape can carry):
        it is refused here, before it reaches the engine."""
        mac = hmac.new(self.secret, tenant.encode("utf-8", "surrogatepass"), hashlib.sha256)
        base = f"{tenant}{_SALT_SEPARATOR}{mac.hexdigest()}"
        if client_salt is None:
            return base
        _check_client_salt(client_salt)
        return f"{base}{_SALT_SEPARATOR}{client_salt}"


def _check_client_salt(client_salt: str) -> None:
    if len(client_salt) > MAX_CLIENT_SALT_CHARS:
        raise InvalidRequestError(
            f"cache_salt must be at most {MAX_CLIENT_SALT_CHARS} characters", "cache_salt")
    try:
        client_salt.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError(
            "cache_salt must be valid Unicode text (no lone surrogates)", "cache_salt") from None


def tenant_of_salt(cache_salt: str | None) -> str | None:
    """The tenant a `TenantSalts.cache_salt` salt was derived from; None for no salt (a request
    the server did not send, e.g. one added to the engine directly)."""
    if cache_salt is None:
        return None
    return cache_salt.partition(_SALT_SEPARATOR)[0]


def _check_tenant(tenant: str) -> None:
    if not tenant or _SALT_SEPARATOR in tenant or tenant != tenant.strip():
        raise ValueError("tenant names must be non-empty, without NUL or edge whitespace")

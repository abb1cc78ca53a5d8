"""Pure ASGI middleware that runs before any route: authentication, then the body-size limit.

Which key a path needs (`AccessPolicy`): /health, /ping and /dashboard none (the dashboard is
a static page that asks for a key itself); /metrics a tenant, admin or metrics key
(`--metrics-api-key`), or none with `--allow-unauthenticated-metrics`; every other path, unknown
ones included, a tenant or admin key (`--admin-api-key`). With no key of the kinds a path takes
configured, the path is open.

Besides `request.state.tenant`, the middleware sets `request.state.sees_all_tenants`: true for
an admin key, and for every request on a path that needs no key (authentication off), where
there is no tenant to hide anything from.

A key is presented as `Authorization: Bearer <key>` (OpenAI's clients) or as `x-api-key: <key>`
(Anthropic's); with both headers, the Authorization header is the one read. Refusals are
rendered by `error_response`, in the shape of the API the path belongs to.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched. A rejected request costs no work: authentication looks at
headers only, and an oversized body is refused from its Content-Length or, for a chunked body,
as soon as the bytes read exceed the limit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpool.openai.auth import ADMIN_TENANT, DEFAULT_TENANT, ApiKeyTable
from kvpool.openai.errors import OpenAIError, error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/dashboard"})
METRICS_PATH = "/metrics"


@dataclass(frozen=True, slots=True)
class AccessPolicy:
    """The keys each path accepts. `admin_keys` (tenant `ADMIN_TENANT`) are accepted wherever
    the tenants' keys are; `metrics_keys` on /metrics only (tenant `METRICS_TENANT`);
    `is_metrics_open` lets /metrics be scraped without any key."""

    keys: ApiKeyTable = field(default_factory=ApiKeyTable)
    metrics_keys: ApiKeyTable = field(default_factory=ApiKeyTable)
    is_metrics_open: bool = False
    admin_keys: ApiKeyTable = field(default_factory=ApiKeyTable)

    def keys_for(self, path: str) -> ApiKeyTable | None:
        """The keys that may open `path`; None: it is open."""
        if path in OPEN_PATHS or (path == METRICS_PATH and self.is_metrics_open):
            return None
        entries = self.keys.entries + self.admin_keys.entries
        if path == METRICS_PATH:
            entries += self.metrics_keys.entries
        return ApiKeyTable(entries) if entries else None


class AuthMiddleware:
    """Every path `policy` guards needs a key it accepts there, as `Authorization: Bearer <key>`
    or `x-api-key: <key>`. The authenticated tenant is put in `request.state.tenant` (the default
    tenant on an open path), and whether it may see every tenant in
    `request.state.sees_all_tenants` (module docstring)."""

    def __init__(self, app: ASGIApp, policy: AccessPolicy) -> None:
        self.app = app
        self.policy = policy

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant: str | None = DEFAULT_TENANT
        keys = self.policy.keys_for(scope["path"])
        if keys is not None:
            tenant = keys.authenticate(_header(scope, b"authorization"),
                                       _header(scope, b"x-api-key"))
            if tenant is None:
                await _send_error(scope, receive, send, _unauthorized(scope))
                return
        state = scope.setdefault("state", {})
        state["tenant"] = tenant
        # ServerConfig reserves the admin tenant's name for admin keys.
        state["sees_all_tenants"] = keys is None or tenant == ADMIN_TENANT
        await self.app(scope, receive, send)


class BodyTooLarge(StarletteHTTPException):
    """Raised from `receive`: an HTTPException, so FastAPI's body reader re-raises it as is
    (anything else it would turn into a 400) and the error handlers answer 413."""

    def __init__(self) -> None:
        super().__init__(413)


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _header(scope, b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await _send_error(scope, receive, send, self._too_large())
            return
        num_bytes = 0
        is_response_started = False

        async def counting_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_bytes:
                    raise BodyTooLarge()
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal is_response_started
            is_response_started = is_response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counting_receive, tracking_send)
        except BodyTooLarge:
            if not is_response_started:
                await error_response(scope, self._too_large())(scope, receive, send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(413, f"the request body exceeds {self.max_bytes} bytes")


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _unauthorized(scope: Scope) -> OpenAIError:
    if _header(scope, b"authorization") is None and _header(scope, b"x-api-key") is None:
        message = "no API key given: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
        return OpenAIError(401, message)
    return OpenAIError(401, "incorrect API key provided")


async def _send_error(scope: Scope, receive: Receive, send: Send, error: OpenAIError) -> None:
    headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
    await error_response(scope, error, headers)(scope, receive, send)

"""Pure ASGI middleware that runs before any route: authentication, then the body-size limit.

Pure ASGI (not Starlette's BaseHTTPMiddleware) so streaming responses and client-disconnect
messages pass through untouched. A rejected request costs no work: authentication looks at
headers only, and an oversized body is refused from its Content-Length or, for a chunked body,
as soon as the bytes read exceed the limit.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvpool.server.auth import DEFAULT_TENANT, ApiKeyTable
from kvpool.server.errors import OpenAIError

OPEN_PATHS = frozenset({"/health"})


class AuthMiddleware:
    """With keys configured, every path except /health needs `Authorization: Bearer <key>`.
    The authenticated tenant is put in `request.state.tenant`."""

    def __init__(self, app: ASGIApp, keys: ApiKeyTable) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant: str | None = DEFAULT_TENANT
        if self.keys.is_enabled and scope["path"] not in OPEN_PATHS:
            tenant = self.keys.authenticate(_header(scope, b"authorization"))
            if tenant is None:
                await _send_error(scope, receive, send, _unauthorized(scope))
                return
        scope.setdefault("state", {})["tenant"] = tenant
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
                await self._too_large().response()(scope, receive, send)

    def _too_large(self) -> OpenAIError:
        return OpenAIError(
            413, f"the request body exceeds {self.max_bytes} bytes", code="request_too_large"
        )


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _unauthorized(scope: Scope) -> OpenAIError:
    if _header(scope, b"authorization") is None:
        message = "no API key given: send 'Authorization: Bearer <key>'"
        return OpenAIError(401, message, code="missing_api_key")
    return OpenAIError(401, "incorrect API key provided", code="invalid_api_key")


async def _send_error(scope: Scope, receive: Receive, send: Send, error: OpenAIError) -> None:
    headers = {"WWW-Authenticate": "Bearer"} if error.status_code == 401 else None
    await error.response(headers=headers)(scope, receive, send)

"""Every error the server returns, in OpenAI's shape as vLLM fills it:
`{"error": {"message", "type", "param", "code"}}`, where `code` is the HTTP status as an integer
(vLLM's `ErrorInfo.code`) and `type` is OpenAI's error type for that status. vLLM's errors carry
no finer machine-readable reason, and neither do these: a client tells a missing key from a
wrong one, or a context overflow from another 400, by `param` and the message.

FastAPI's own errors (422 validation, 404 route, 405 method, body parse failures) are converted
here, so no response ever carries FastAPI's `{"detail": ...}`. Messages are cut to
`MAX_MESSAGE_CHARS` and never include the offending input itself (pydantic's `input` is dropped),
so a client cannot make the server echo an unbounded value back. The one exception is OpenAI's
own: an unknown model's name, cut to 64 characters. Lone surrogates in a message are replaced,
so an error body can always be encoded.

Another API served beside OpenAI's (Anthropic's Messages API on /v1/messages) answers in its
own shape: it gives `install_error_handlers` an `ErrorShape` for its path, and every error on
that path, from a route, a handler here or the middleware, goes out through `error_response`,
the one place a body's shape is chosen. Routes keep raising `OpenAIError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Scope

from kvpool.openai.protocol import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 300

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class OpenAIError(Exception):
    """An HTTP error with OpenAI's body; raise it anywhere in a route."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.headers = headers
        self.status_code = status_code
        self.message = message
        self.param = param
        self.error_type = error_type or _TYPE_BY_STATUS.get(status_code, "invalid_request_error")

    def safe_text(self) -> tuple[str, str | None]:
        """The message and param as any error body may carry them: cut, and encodable."""
        param = None if self.param is None else _encodable(truncate(self.param, 64))
        return _encodable(truncate(self.message)), param

    def body(self) -> dict[str, Any]:
        message, param = self.safe_text()
        detail = ErrorDetail(message=message, type=self.error_type, param=param,
                             code=self.status_code)
        return ErrorResponse(error=detail).model_dump()


@dataclass(frozen=True, slots=True)
class ErrorShape:
    """Errors on `path`, and on the paths below it, get `body(error)` instead of OpenAI's."""

    path: str
    body: Callable[[OpenAIError], dict[str, Any]]

    def owns(self, path: str) -> bool:
        return path == self.path or path.startswith(f"{self.path}/")


def error_response(scope: Scope, error: OpenAIError,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """`error` as the answer to the request of `scope`, in the shape of the API its path
    belongs to: the app's `ErrorShape`s (`install_error_handlers`), else OpenAI's."""
    shapes: tuple[ErrorShape, ...] = getattr(scope["app"].state, "error_shapes", ())
    shape = next((shape for shape in shapes if shape.owns(scope["path"])), None)
    body = error.body() if shape is None else shape.body(error)
    headers = headers if headers is not None else error.headers
    return JSONResponse(body, status_code=error.status_code, headers=headers)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param)


def truncate(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _encodable(text: str) -> str:
    """`text` with lone surrogates (which JSON's `\\ud800` escape can put into a model name)
    replaced, so that the body can be encoded as UTF-8 instead of failing with a 500."""
    return text.encode("utf-8", "replace").decode("utf-8")


def validation_message(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A one-line message and the offending parameter from pydantic's error list."""
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    # Drop FastAPI's leading "body" and pydantic's union-branch tags ("str", "list[int]").
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    loc = [part for part in loc if not any(ch in part for ch in "[]") and part != "str"]
    param = ".".join(loc) or None
    message = str(first.get("msg", "invalid value"))
    if param is None:
        return f"the request body must be a JSON object ({message})", None
    return f"{param}: {message}", loc[0]


async def _openai_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, OpenAIError)
    return error_response(request.scope, error)


async def _validation_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    message, param = validation_message(error.errors())
    return error_response(request.scope, bad_request(message, param))


async def _http_error(request: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    status = error.status_code
    message = {
        400: "the request body could not be parsed",
        404: "no such route",
        405: "method not allowed on this route",
        413: "the request body is too large",
    }.get(status, "request failed")
    return error_response(request.scope, OpenAIError(status, message), headers=error.headers)


async def _internal_error(request: Request, error: Exception) -> JSONResponse:
    logger.exception("unhandled error", exc_info=error)
    return error_response(request.scope, OpenAIError(500, "internal server error"))


def install_error_handlers(app: FastAPI, *shapes: ErrorShape) -> None:
    """Render every error of `app` in OpenAI's shape, or in the shape of an API that owns the
    request's path (`shapes`; the middleware reads them from the app's state too)."""
    app.state.error_shapes = shapes
    app.add_exception_handler(OpenAIError, _openai_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

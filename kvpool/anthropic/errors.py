"""Any error the server raises (`OpenAIError`), as Anthropic's body:
`{"type": "error", "error": {"type": ..., "message": ...}}`, with the same HTTP status.

The type is Anthropic's name for the status. Anthropic's body has no `param`, so the field at
fault leads the message instead, under its name in this API: the chat path that does the work
names fields as OpenAI calls them (`stop`, `tools[0].function.parameters`), and those are
renamed to Anthropic's (`stop_sequences`, `tools[0].input_schema`). The message and the field
are the ones `OpenAIError` makes safe to send (cut, encodable).
"""

from __future__ import annotations

from typing import Any

from kvpool.anthropic.protocol import ErrorDetail, ErrorResponse
from kvpool.openai.errors import OpenAIError

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",  # shutting down or out of room: come back later, or elsewhere
    529: "overloaded_error",
}
# OpenAI's field names that Anthropic spells otherwise (the chat request's, in `convert.py`).
_RENAMED_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens",
                   "prompt": "messages"}  # the engine names the rendered prompt "prompt"
_RENAMED_PARTS = ((".function.parameters", ".input_schema"), (".function.name", ".name"))


def error_type(status_code: int) -> str:
    default = "invalid_request_error" if status_code < 500 else "api_error"
    return _TYPE_BY_STATUS.get(status_code, default)


def anthropic_error(error: OpenAIError) -> ErrorResponse:
    message, param = error.safe_text()
    if param is not None and not message.startswith(param):
        message = f"{anthropic_param(param)}: {message}"
    return ErrorResponse(error=ErrorDetail(type=error_type(error.status_code), message=message))


def error_body(error: OpenAIError) -> dict[str, Any]:
    return anthropic_error(error).model_dump()


def anthropic_param(param: str) -> str:
    """The name Anthropic's request gives the chat request's field `param`."""
    param = _RENAMED_PARAMS.get(param, param)
    for openai_part, anthropic_part in _RENAMED_PARTS:
        param = param.replace(openai_part, anthropic_part)
    return param

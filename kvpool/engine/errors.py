"""The engine's error types: what a caller did wrong, told apart by type, never by message text.

`InvalidRequestError` is a `ValueError`, so offline code that catches `ValueError` keeps
working; the server reads its `param` to name the offending field in OpenAI's error body.
Messages name the field and the allowed range, never the offending value itself: a server
must not echo unbounded client input back.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request (prompt, sampling parameters, ids) the engine refuses before running it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field at fault, e.g. "temperature", "prompt", "n"

"""`RequestStream`: one request's outputs, handed from the engine thread to an asyncio caller.

The engine thread calls `put` (thread-safe: it schedules delivery on the consumer's loop); the
consumer iterates with `async for`. It holds at most one output not yet taken, so a slow
consumer never makes outputs pile up (class docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from kvpool.engine.requests.outputs import RequestOutput, merge_deltas
from kvpool.engine.sampling_params import RequestOutputKind


class _Aborts(Protocol):
    """What a stream needs of its engine: a way to abort its request (`AsyncLLMEngine`)."""

    def abort(self, request_id: str) -> None: ...


class RequestStream:
    """The outputs of one request, as an async iterator that ends after the finished one.

    The stream holds at most one output not yet taken: a consumer that lags (a slow client)
    gets the newest cumulative output, or for `RequestOutputKind.DELTA` every delta since it
    last took one merged into one (`merge_deltas`), so nothing piles up and nothing is lost.
    Leaving `async with stream:` before the end aborts the request.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, engine: _Aborts,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE):
        self.request_id = request_id
        self.is_finished = False
        self.loop = loop
        self._engine = engine
        self._is_delta = output_kind is RequestOutputKind.DELTA
        self._latest: RequestOutput | None = None  # newest output not yet taken
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Hand an output or error to the consumer (called from the engine thread)."""
        with contextlib.suppress(RuntimeError):  # the consumer's loop closed: nobody listens
            self.loop.call_soon_threadsafe(self._deliver, item)

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            self._error = item
        elif self._latest is not None and self._is_delta:
            self._latest = merge_deltas(self._latest, item)
        else:
            self._latest = item
        self._ready.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.is_finished:
            raise StopAsyncIteration
        while self._latest is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._latest is not None:  # an output that came before an error is still given
            output, self._latest = self._latest, None
            self.is_finished = output.finished
            return output
        self.is_finished = True
        assert self._error is not None
        raise self._error

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.abort_if_unfinished()

    def abort_if_unfinished(self) -> None:
        if not self.is_finished:
            self.is_finished = True
            self._engine.abort(self.request_id)

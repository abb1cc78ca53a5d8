"""One HTTP request's life in the engine: a concurrency slot, its engine requests, their end.

    state.begin()            429 beyond max_concurrent_requests, 503 while shutting down
    generation.add(inputs)   one engine request per prompt, all queued at once; 400 on bad input
    generation.outputs()     the prompts' outputs merged as they come (streaming)
    generation.collect(req)  the final outputs, or ClientDisconnected as soon as the client goes
    generation.close()       aborts whatever is unfinished and frees the slot (idempotent)

Every route closes its generation on every path (a `finally`, or the streaming response's
background task), so a disconnected client's blocks go back to the pool at the engine thread's
next iteration, and no slot leaks.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from kvpool.engine.async_engine import AsyncLLMEngine, EngineClosedError, RequestStream
from kvpool.engine.outputs import RequestOutput
from kvpool.server.config import ServerConfig
from kvpool.server.errors import OpenAIError, bad_request, truncate
from kvpool.server.inputs import EngineInputs
from kvpool.server.metrics import ServerMetrics


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


@dataclass
class ServerState:
    """Everything the routes share; lives on `app.state.kvpool`. Touched only from the event
    loop, so the in-flight counter needs no lock."""

    engine: AsyncLLMEngine
    config: ServerConfig
    metrics: ServerMetrics
    created: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0
    shutdown_started_at: float | None = None

    def check_model(self, name: str | None) -> str:
        """The model name to report; 404 (as OpenAI answers) for a name not served here."""
        if name is None or name in self.config.served_model_names:
            return name or self.config.model_name
        raise OpenAIError(
            404, f"the model `{truncate(name, 64)}` does not exist", "model", "model_not_found"
        )

    def begin(self) -> Generation:
        if not self.engine.is_accepting or self.shutdown_started_at is not None:
            raise OpenAIError(503, "the server is shutting down", code="service_unavailable")
        limit = self.config.max_concurrent_requests
        if limit is not None and self.num_in_flight >= limit:
            raise OpenAIError(
                429, f"more than {limit} concurrent requests; retry later",
                code="rate_limit_exceeded", headers={"Retry-After": "1"},
            )
        self.num_in_flight += 1
        return Generation(self)

    def begin_shutdown(self) -> None:
        """Refuse new generation requests from now on (SIGTERM/Ctrl-C)."""
        self.shutdown_started_at = self.shutdown_started_at or time.monotonic()


class Generation:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.streams: list[RequestStream] = []
        self._is_closed = False

    async def add(self, inputs: EngineInputs, cache_salt: str, request_id: str) -> None:
        """Queue every prompt at once (one trip to the engine thread, not one per prompt)."""
        adds = [
            self.state.engine.add_request(
                prompt.as_engine_input(), params, f"{request_id}-{index}", cache_salt=cache_salt
            )
            for index, (prompt, params) in enumerate(zip(inputs.prompts, inputs.params,
                                                         strict=True))
        ]
        results = await asyncio.gather(*adds, return_exceptions=True)
        self.streams = [result for result in results if isinstance(result, RequestStream)]
        errors = [result for result in results if isinstance(result, BaseException)]
        if not errors:
            return
        self.close()
        error = errors[0]
        if isinstance(error, ValueError):  # the engine's own checks: the prompt, or n
            message = str(error)
            raise bad_request(message, "n" if message.startswith("n=") else "prompt") from error
        if isinstance(error, EngineClosedError):
            raise OpenAIError(503, "the server is shutting down", code="service_unavailable")
        raise error

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) as outputs arrive from any of the prompts."""
        pending = {asyncio.ensure_future(anext(s)): index for index, s in enumerate(self.streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in done:
                    index = pending.pop(future)
                    try:
                        output = future.result()
                    except StopAsyncIteration:
                        continue
                    if output.finished:
                        self.state.metrics.observe_finished(output)
                    else:
                        pending[asyncio.ensure_future(anext(self.streams[index]))] = index
                    yield index, output
        finally:
            for future in pending:
                future.cancel()

    async def collect(self, request: Request) -> list[RequestOutput]:
        """Every prompt's final output; ClientDisconnected if the client leaves first."""
        finals: dict[int, RequestOutput] = {}

        async def consume() -> None:
            async for index, output in self.outputs():
                if output.finished:
                    finals[index] = output

        consumer = asyncio.ensure_future(consume())
        watcher = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({consumer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not consumer.done():
                consumer.cancel()
        if not consumer.done() or consumer.cancelled():
            raise ClientDisconnected
        consumer.result()  # raises the engine's error, if any
        return [finals[index] for index in range(len(self.streams))]

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        for stream in self.streams:
            stream.abort_if_unfinished()
        self.state.num_in_flight -= 1


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so `receive` only ever
    yields `http.disconnect` now)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

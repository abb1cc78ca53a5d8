"""One HTTP request's life in the engine: its admission slots, its engine requests, their end.

    state.begin()              429 beyond max_concurrent_requests, 503 while shutting down
    generation.add(inputs)     429 beyond max_queued_sequences (400 if the request alone is),
                               then one engine request per prompt, all queued at once; 400 on
                               input the engine refuses (its `InvalidRequestError.param`)
    generation.outputs()       the prompts' outputs merged as they come (deltas when streaming)
    generation.collect(req)    the final outputs, or ClientDisconnected as soon as the client goes
    generation.close()         aborts whatever is unfinished and frees the slots (idempotent)

Every route closes its generation on every path (a `finally`, or the streaming response's
background task), so a disconnected client's blocks go back to the pool at the engine thread's
next iteration, and no slot leaks. The generation counts each completion's tokens as outputs
pass (a DELTA output carries only the new ones): a stream's usage and the per-request token
metrics are computed from those counts. Every output is shown to the metrics as it passes, for
the inter-token gaps it carries (the engine's step times, not the time the output reached
the event loop: that is what vLLM's inter-token latency measures, and it works the same for a
whole response, whose one output carries all its gaps).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.requests import Request

from kvpool.engine.async_engine import AsyncLLMEngine, EngineClosedError, RequestStream
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.openai.errors import OpenAIError, bad_request, truncate
from kvpool.server.config import ServerConfig
from kvpool.server.input_work import InputWork
from kvpool.server.inputs import EngineInputs
from kvpool.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)

RETRY_AFTER = {"Retry-After": "1"}


class ClientDisconnected(Exception):
    """The client went away before its response was ready."""


@dataclass
class ServerState:
    """Everything the routes share; lives on `app.state.kvpool`. Touched only from the event
    loop, so the in-flight counters need no lock."""

    engine: AsyncLLMEngine
    config: ServerConfig
    metrics: ServerMetrics
    input_work: InputWork  # where input work runs: tenants in turn, grammars bounded
    created: int = field(default_factory=lambda: int(time.time()))
    num_in_flight: int = 0  # generation requests
    num_sequences_in_flight: int = 0  # their prompts × n, summed
    shutdown_started_at: float | None = None

    def check_model(self, name: str | None) -> str:
        """The model name to report; 404 (as OpenAI answers) for a name not served here. The
        name is cut to 64 characters in the message, as OpenAI's own message cuts it."""
        if name is None or name in self.config.served_model_names:
            return name or self.config.model_name
        raise OpenAIError(404, f"the model `{truncate(name, 64)}` does not exist", "model")

    def begin(self) -> Generation:
        if not self.engine.is_accepting or self.shutdown_started_at is not None:
            raise OpenAIError(503, "the server is shutting down")
        limit = self.config.max_concurrent_requests
        if limit is not None and self.num_in_flight >= limit:
            raise OpenAIError(429, f"more than {limit} concurrent requests; retry later",
                              headers=dict(RETRY_AFTER))
        self.num_in_flight += 1
        return Generation(self)

    def reserve_sequences(self, num_sequences: int) -> None:
        """Count `num_sequences` (prompts × n) as in flight, or refuse them: 429 while others
        hold the room, 400 if the request alone could never fit."""
        limit = self.config.max_queued_sequences
        if limit is not None and num_sequences > limit:
            raise bad_request(
                f"a request may run at most {limit} sequences (prompts × n) on this server", "n"
            )
        if limit is not None and self.num_sequences_in_flight + num_sequences > limit:
            raise OpenAIError(
                429, f"more than {limit} sequences (prompts × n) in flight; retry later",
                headers=dict(RETRY_AFTER),
            )
        self.num_sequences_in_flight += num_sequences

    def begin_shutdown(self) -> None:
        """Refuse new generation requests from now on (SIGTERM/Ctrl-C)."""
        self.shutdown_started_at = self.shutdown_started_at or time.monotonic()


class Generation:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.streams: list[RequestStream] = []
        self.finals: dict[int, RequestOutput] = {}  # prompt index -> its finished output
        # Per prompt: completion index -> tokens seen so far (summed over deltas).
        self.num_output_tokens: list[dict[int, int]] = []
        self._num_sequences = 0
        self._is_closed = False

    @property
    def num_completion_tokens(self) -> int:
        return sum(sum(counts.values()) for counts in self.num_output_tokens)

    def final_outputs(self) -> list[RequestOutput]:
        """The prompts' finished outputs, in prompt order (those that finished)."""
        return [self.finals[index] for index in sorted(self.finals)]

    async def add(self, inputs: EngineInputs, cache_salt: str, request_id: str) -> None:
        """Queue every prompt at once (one trip to the engine thread, not one per prompt)."""
        num_sequences = sum(params.n for params in inputs.params)
        self.state.reserve_sequences(num_sequences)
        self._num_sequences = num_sequences
        adds = [
            self.state.engine.add_request(
                prompt.as_engine_input(), params, f"{request_id}-{index}",
                priority=inputs.priority, cache_salt=cache_salt,
            )
            for index, (prompt, params) in enumerate(zip(inputs.prompts, inputs.params,
                                                         strict=True))
        ]
        results = await asyncio.gather(*adds, return_exceptions=True)
        self.streams = [result for result in results if isinstance(result, RequestStream)]
        self.num_output_tokens = [{} for _ in self.streams]
        errors = [result for result in results if isinstance(result, BaseException)]
        if not errors:
            return
        self.close()
        failure = _add_failure(errors[0])
        if failure is None:
            raise errors[0]
        raise failure from errors[0]

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
                    self._count(index, output)
                    if not output.finished:
                        pending[asyncio.ensure_future(anext(self.streams[index]))] = index
                    yield index, output
        finally:
            for future in pending:
                future.cancel()

    def _count(self, index: int, output: RequestOutput) -> None:
        counts = self.num_output_tokens[index]
        for completion in output.outputs:
            counts[completion.index] = counts.get(completion.index, 0) + len(completion.token_ids)
        self.state.metrics.observe_output(output)
        if output.finished:
            self.finals[index] = output
            self.state.metrics.observe_finished(output, counts)

    async def collect(self, request: Request) -> list[RequestOutput]:
        """Every prompt's final output; ClientDisconnected if the client leaves first."""

        async def consume() -> None:
            async for _ in self.outputs():
                pass

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
        return self.final_outputs()

    def close(self) -> None:
        if self._is_closed:
            return
        self._is_closed = True
        for stream in self.streams:
            stream.abort_if_unfinished()
        self.state.num_in_flight -= 1
        self.state.num_sequences_in_flight -= self._num_sequences


def _add_failure(error: BaseException) -> OpenAIError | None:
    """The HTTP error for an add the engine refused, told by the error's type (never by its
    text); None for an error that is not the request's fault."""
    if isinstance(error, InvalidRequestError):  # its message names no client value
        return bad_request(str(error), error.param)
    if isinstance(error, ValueError):  # not one of the engine's typed checks: a bare message
        logger.info("the engine refused a prompt: %s", type(error).__name__)
        return bad_request("the prompt cannot be run", "prompt")
    if isinstance(error, EngineClosedError):
        return OpenAIError(503, "the server is shutting down")
    return None


async def _wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body has been read, so `receive` only ever
    yields `http.disconnect` now)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

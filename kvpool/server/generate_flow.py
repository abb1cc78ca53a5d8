"""The path every generation route shares, whatever API it speaks: the tenant's cache salt,
an admission slot, the engine inputs built on the input executor (tokenizing can take a while;
the event loop must not wait for it, nor another tenant: `input_work.py`), room for their
sequences, then either a server-sent event stream or the final outputs while watching for a
disconnect. The generation is closed on every path (a `finally`, or the streaming response's
background task), so a client that left gives its blocks back at the engine's next iteration.

A route supplies how to build its inputs, how to stream and how to answer; the OpenAI routes
(`routes.py`) and the other APIs' routes use this one flow.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.background import BackgroundTask

from kvpool.engine.async_engine import EngineClosedError, EngineError, RequestFailedError
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.openai.errors import OpenAIError, bad_request
from kvpool.server.generation import ClientDisconnected, Generation, ServerState
from kvpool.server.inputs import EngineInputs
from kvpool.server.streams import SSE_DONE, ChatStreamer, CompletionStreamer

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it


class GenerationBody(Protocol):
    """What the flow reads from a request body (the model is checked by the route)."""

    stream: bool | None
    cache_salt: str | None


def server_state(request: Request) -> ServerState:
    return request.app.state.kvpool


async def run_generation(
    request: Request,
    state: ServerState,
    body: GenerationBody,
    make_inputs: Callable[..., EngineInputs],
    response_id: str,
    stream_events: Callable[[Generation, EngineInputs], AsyncIterator[str]],
    respond: Callable[[list[RequestOutput], EngineInputs], Any],
) -> Response:
    try:
        cache_salt = state.config.tenant_salts.cache_salt(request.state.tenant,
                                                          body.cache_salt)
    except InvalidRequestError as error:
        raise bad_request(str(error), error.param) from error
    generation = state.begin()
    is_streaming = False
    try:
        tenant = request.state.tenant
        inputs = await state.input_work.run(tenant, make_inputs, body, state.engine,
                                            state.config, state.input_work.grammars(tenant))
        await generation.add(inputs, cache_salt, response_id)
        if body.stream:
            is_streaming = True
            return StreamingResponse(
                stream_events(generation, inputs),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
                background=BackgroundTask(generation.close),
            )
        try:
            outputs = await generation.collect(request)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        except (EngineError, EngineClosedError) as error:
            raise engine_failure(error) from error
        return JSONResponse(respond(outputs, inputs).model_dump())
    finally:
        if not is_streaming:
            generation.close()


async def sse_events(
    generation: Generation, streamer: CompletionStreamer | ChatStreamer, include_usage: bool
) -> AsyncIterator[str]:
    """OpenAI's stream: the streamer's chunks, a usage chunk if asked for, then `[DONE]`."""
    try:
        async for index, output in generation.outputs():
            for event in streamer.chunks(index, output):
                yield event
        if include_usage:
            yield streamer.usage_chunk(generation.final_outputs(),
                                       generation.num_completion_tokens)
    except (EngineError, EngineClosedError) as error:
        yield f"data: {json.dumps(engine_failure(error).body())}\n\n"
    finally:
        generation.close()
    yield SSE_DONE


async def prefixed(first: list[str], rest: AsyncIterator[str]) -> AsyncIterator[str]:
    for event in first:
        yield event
    async for event in rest:
        yield event


def engine_failure(error: Exception) -> OpenAIError:
    """The error a request gets when the engine stopped under it."""
    if isinstance(error, EngineClosedError):
        return OpenAIError(503, "the request was aborted: the server is shutting down")
    if isinstance(error, RequestFailedError):  # its KV never came from the prefill worker
        return OpenAIError(502, str(error))
    return OpenAIError(500, "the engine failed while running this request")

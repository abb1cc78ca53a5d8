"""The HTTP endpoints: OpenAI's completions and chat completions, plus /health, /metrics and
/v1/kv/stats (models, tokenize, version and ping: `utility_routes.py`).

A generation route: check the model name and the cache salt, take a concurrency slot, build the
engine inputs on the input executor (tokenizing can take a while; the event loop must not wait
for it, nor another tenant: `input_work.py`), take room for their sequences and queue them,
then either stream server-sent events (from DELTA outputs) or wait for the end (one FINAL_ONLY
output per prompt) while watching for a disconnect.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from kvpool.engine.async_engine import EngineClosedError, EngineError
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.openai.errors import OpenAIError, bad_request
from kvpool.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
)
from kvpool.server.chat_inputs import chat_inputs
from kvpool.server.generation import ClientDisconnected, Generation, ServerState
from kvpool.server.inputs import EngineInputs, completion_inputs
from kvpool.server.responses import chat_response, completion_response
from kvpool.server.streams import SSE_DONE, ChatStreamer, CompletionStreamer

CLIENT_CLOSED_REQUEST = 499  # nginx's status for a client that left; nobody reads it

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)
}

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.kvpool


@router.get("/health", responses=_ERRORS)
async def health(request: Request) -> dict[str, str]:
    """200 while the server takes requests; 503 once it is shutting down (draining), so that
    a router or load balancer stops sending it new ones, or when the engine cannot step."""
    state = _state(request)
    engine = state.engine
    if state.shutdown_started_at is not None:
        raise OpenAIError(503, "shutting down: finishing the requests in flight")
    if not engine.is_healthy:
        reason = engine.unhealthy_reason or "the engine thread is not running"
        raise OpenAIError(503, f"unhealthy: {reason}")
    return {"status": "ok"}


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/kv/stats", responses=_ERRORS)
async def kv_stats(request: Request) -> dict[str, Any]:
    """The block pool's snapshot (as of the engine's latest iteration), request counts, the
    KV memory behind the pool (online blocks, segments, arena), and the tiers below it (host,
    disk; swap preemption; prompt tokens served per tier)."""
    snapshot = _state(request).engine.snapshot()
    return {
        **dataclasses.asdict(snapshot.memory),
        "num_requests_running": snapshot.num_requests_running,
        "num_requests_waiting": snapshot.num_requests_waiting,
        "num_preemptions": snapshot.stats.num_preemptions,
        "kv_pool": dataclasses.asdict(snapshot.kv_pool),
        "kv_tiers": {
            **dataclasses.asdict(snapshot.kv_tiers),
            **snapshot.stats.swap_fields(),
        },
    }


@router.post("/v1/completions", response_model=Completion, responses=_ERRORS)
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = _state(request)
    model = state.check_model(body.model)
    created, response_id = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    num_top, n = body.logprobs or 0, body.n or 1

    def stream_events(generation: Generation, inputs: EngineInputs) -> AsyncIterator[str]:
        streamer = CompletionStreamer(response_id, created, model, n, num_top, inputs)
        return _sse_events(generation, streamer, _wants_usage(body))

    def respond(outputs: list[RequestOutput], inputs: EngineInputs) -> Completion:
        return completion_response(response_id, created, model, outputs, inputs, n, num_top)

    return await _generate(request, state, body, completion_inputs, response_id,
                           stream_events, respond)


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = _state(request)
    model = state.check_model(body.model)
    created, response_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    num_top = body.top_logprobs or 0

    def stream_events(generation: Generation, inputs: EngineInputs) -> AsyncIterator[str]:
        streamer = ChatStreamer(response_id, created, model, num_top, inputs)
        events = _sse_events(generation, streamer, _wants_usage(body))
        return _prefixed(streamer.role_chunks(body.n or 1), events)

    def respond(outputs: list[RequestOutput], inputs: EngineInputs) -> ChatCompletion:
        return chat_response(response_id, created, model, outputs[0], inputs, num_top)

    return await _generate(request, state, body, chat_inputs, response_id,
                           stream_events, respond)


async def _generate(
    request: Request,
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
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
            raise _engine_failure(error) from error
        return JSONResponse(respond(outputs, inputs).model_dump())
    finally:
        if not is_streaming:
            generation.close()


async def _sse_events(
    generation: Generation, streamer: CompletionStreamer | ChatStreamer, include_usage: bool
) -> AsyncIterator[str]:
    try:
        async for index, output in generation.outputs():
            for event in streamer.chunks(index, output):
                yield event
        if include_usage:
            yield streamer.usage_chunk(generation.final_outputs(),
                                       generation.num_completion_tokens)
    except (EngineError, EngineClosedError) as error:
        yield f"data: {json.dumps(_engine_failure(error).body())}\n\n"
    finally:
        generation.close()
    yield SSE_DONE


async def _prefixed(first: list[str], rest: AsyncIterator[str]) -> AsyncIterator[str]:
    for event in first:
        yield event
    async for event in rest:
        yield event


def _engine_failure(error: Exception) -> OpenAIError:
    if isinstance(error, EngineClosedError):
        return OpenAIError(503, "the request was aborted: the server is shutting down")
    return OpenAIError(500, "the engine failed while running this request")


def _wants_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)

"""The HTTP endpoints: OpenAI's completions and chat completions, plus /health, /metrics and
/v1/kv/stats (models, tokenize, version and ping: `utility_routes.py`).

A generation route checks the model name, then runs the flow every API shares
(`generate_flow.py`) with its own inputs, stream and response.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from kvpool.engine.requests.outputs import RequestOutput
from kvpool.openai.errors import OpenAIError
from kvpool.openai.protocol import (
    ChatCompletion,
    ChatCompletionRequest,
    Completion,
    CompletionRequest,
    ErrorResponse,
)
from kvpool.server.chat_inputs import chat_inputs
from kvpool.server.generate_flow import prefixed, run_generation, server_state, sse_events
from kvpool.server.generation import Generation
from kvpool.server.inputs import EngineInputs, completion_inputs
from kvpool.server.responses import chat_response, completion_response
from kvpool.server.streams import ChatStreamer, CompletionStreamer

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)
}

router = APIRouter()


@router.get("/health", responses=_ERRORS)
async def health(request: Request) -> dict[str, str]:
    """200 while the server takes requests; 503 once it is shutting down (draining), so that
    a router or load balancer stops sending it new ones, or when the engine cannot step."""
    state = server_state(request)
    engine = state.engine
    if state.shutdown_started_at is not None:
        raise OpenAIError(503, "shutting down: finishing the requests in flight")
    if not engine.is_healthy:
        reason = engine.unhealthy_reason or "the engine thread is not running"
        raise OpenAIError(503, f"unhealthy: {reason}")
    return {"status": "ok"}


@router.get("/metrics", response_class=Response)
async def metrics(request: Request) -> Response:
    return Response(server_state(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@router.get("/v1/kv/stats", responses=_ERRORS)
async def kv_stats(request: Request) -> dict[str, Any]:
    """The block pool's snapshot (as of the engine's latest iteration), request counts, the
    KV memory behind the pool (online blocks, segments, arena), and the tiers below it (host,
    disk; swap preemption; prompt tokens served per tier)."""
    snapshot = server_state(request).engine.snapshot()
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
    state = server_state(request)
    model = state.check_model(body.model)
    created, response_id = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
    num_top, n = body.logprobs or 0, body.n or 1

    def stream_events(generation: Generation, inputs: EngineInputs) -> AsyncIterator[str]:
        streamer = CompletionStreamer(response_id, created, model, n, num_top, inputs)
        return sse_events(generation, streamer, _wants_usage(body))

    def respond(outputs: list[RequestOutput], inputs: EngineInputs) -> Completion:
        return completion_response(response_id, created, model, outputs, inputs, n, num_top)

    return await run_generation(request, state, body, completion_inputs, response_id,
                           stream_events, respond)


@router.post("/v1/chat/completions", response_model=ChatCompletion, responses=_ERRORS)
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_model(body.model)
    created, response_id = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
    num_top = body.top_logprobs or 0

    def stream_events(generation: Generation, inputs: EngineInputs) -> AsyncIterator[str]:
        streamer = ChatStreamer(response_id, created, model, num_top, inputs)
        events = sse_events(generation, streamer, _wants_usage(body))
        return prefixed(streamer.role_chunks(body.n or 1), events)

    def respond(outputs: list[RequestOutput], inputs: EngineInputs) -> ChatCompletion:
        return chat_response(response_id, created, model, outputs[0], inputs, num_top)

    return await run_generation(request, state, body, chat_inputs, response_id,
                           stream_events, respond)


def _wants_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return bool(body.stream_options and body.stream_options.include_usage)

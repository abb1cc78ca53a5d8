"""Anthropic's Messages API: `POST /v1/messages` and `POST /v1/messages/count_tokens`.

A message request is converted into the chat completion request that asks for the same
generation (`kvpool.anthropic.convert`) and runs the chat route's own path: `chat_inputs` (its
prompt, tool plan, constraints, reader) and the flow every API shares (`generate_flow.py`).
Only the answer is Anthropic's: a `Message`, or the stream's events (`kvpool.anthropic.stream`).
count_tokens renders the prompt the same way and counts its tokens.

Every error on these paths is Anthropic-shaped: `ERROR_SHAPE`, which `app.py` installs with the
error handlers, so the handlers and the middleware (401, 413) render them too.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from kvpool.anthropic.convert import chat_request, counting_request, message_response
from kvpool.anthropic.errors import anthropic_error, error_body
from kvpool.anthropic.protocol import (
    CountTokensRequest,
    ErrorResponse,
    Message,
    MessagesRequest,
    TokenCount,
)
from kvpool.anthropic.stream import MessageStreamer, sse_event
from kvpool.engine.async_engine import EngineClosedError, EngineError
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.openai.errors import ErrorShape
from kvpool.openai.prompts import chat_prompt
from kvpool.server.chat_inputs import chat_inputs
from kvpool.server.generate_flow import engine_failure, run_generation, server_state
from kvpool.server.generation import Generation
from kvpool.server.inputs import EngineInputs

MESSAGES_PATH = "/v1/messages"
ERROR_SHAPE = ErrorShape(MESSAGES_PATH, error_body)
_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)
}

router = APIRouter()


@router.post(MESSAGES_PATH, response_model=Message, responses=_ERRORS)
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_model(body.model)
    response_id = f"msg_{uuid.uuid4().hex[:24]}"

    def stream_events(generation: Generation, inputs: EngineInputs) -> AsyncIterator[str]:
        assert inputs.output_parser is not None
        streamer = MessageStreamer(response_id, model, inputs.output_parser.streamer(),
                                   body.stop_sequences)
        return message_events(generation, streamer)

    def respond(outputs: list[RequestOutput], inputs: EngineInputs) -> Message:
        assert inputs.output_parser is not None
        return message_response(response_id, model, outputs[0], inputs.output_parser,
                                body.stop_sequences)

    return await run_generation(request, state, chat_request(body), chat_inputs, response_id,
                                stream_events, respond)


@router.post(f"{MESSAGES_PATH}/count_tokens", response_model=TokenCount, responses=_ERRORS)
async def count_tokens(body: CountTokensRequest, request: Request) -> TokenCount:
    """The prompt's tokens, tools included, as /v1/messages would run it (on the input
    executor, as the generation routes tokenize)."""
    state = server_state(request)
    state.check_model(body.model)
    engine = state.engine
    prompt, _ = await state.input_work.run(
        request.state.tenant, chat_prompt, counting_request(body), engine.tokenizer,
        state.config.chat_template, engine.prompt_limits)
    return TokenCount(input_tokens=len(prompt.token_ids))


async def message_events(generation: Generation, streamer: MessageStreamer
                         ) -> AsyncIterator[str]:
    """The stream's events; an engine failure ends it with an `error` event."""
    try:
        async for _, output in generation.outputs():
            for event in streamer.feed(output):
                yield event
        for event in streamer.end(generation.num_completion_tokens):
            yield event
    except (EngineError, EngineClosedError) as error:
        yield sse_event(anthropic_error(engine_failure(error)))
    finally:
        generation.close()

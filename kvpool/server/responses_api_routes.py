"""`POST /v1/responses`: OpenAI's Responses API, stateless, on the chat completions pipeline.

A request is checked for what this server refuses (state it would have to store, background
runs, extra outputs: `_REFUSED`), translated into a chat request
(`kvpool/openai/responses_api/convert.py`) and run through the flow every API shares
(`generate_flow.run_generation`) with the chat route's inputs (`chat_inputs`): the same
prompt, tool plan, constraints, limits and output reader. A whole response reads the output as
the chat route does; a stream feeds the same reader's pieces into the Responses event sequence
(`responses_api/stream.py`). The chat path's errors are renamed to the Responses fields.

Usage is the chat route's (`kvpool.server.responses.usage`) in the Responses shape; its
`reasoning_tokens` is the thinking's length as the tokenizer encodes it again (the engine
does not mark which tokens thought; the count may differ from the model's own split by a
token at the boundary).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request, Response

from kvpool.engine.async_engine import EngineClosedError, EngineError
from kvpool.engine.requests.outputs import RequestOutput
from kvpool.openai.errors import OpenAIError, bad_request
from kvpool.openai.protocol import ErrorResponse
from kvpool.openai.responses_api.convert import (
    chat_request,
    finished_response,
    output_items,
    response_shell,
    responses_usage,
)
from kvpool.openai.responses_api.errors import responses_error
from kvpool.openai.responses_api.protocol import ResponseObject, ResponsesRequest
from kvpool.openai.responses_api.stream import ResponseEventStream
from kvpool.server.chat_inputs import chat_inputs
from kvpool.server.generate_flow import engine_failure, run_generation, server_state
from kvpool.server.generation import Generation
from kvpool.server.inputs import EngineInputs
from kvpool.server.responses import usage as chat_usage
from kvpool.server.unsupported import Unsupported

_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 413, 429, 500, 503)
}
_STATELESS = "this server stores no responses: send the whole conversation as input"
_REFUSED = (
    Unsupported("previous_response_id", f"previous_response_id is not supported; {_STATELESS}"),
    Unsupported("conversation", f"conversation is not supported; {_STATELESS}"),
    Unsupported("store", f"store true is not supported; {_STATELESS}", (False,)),
    Unsupported("background", "background responses are not supported", (False,)),
    Unsupported("include", "include is not supported (there is nothing extra to add)", ([],)),
    Unsupported("prompt", "stored prompt templates are not supported"),
    Unsupported("truncation", "only truncation disabled is supported", ("disabled",)),
    Unsupported("top_logprobs", "top_logprobs is not supported on /v1/responses", (0,)),
    Unsupported("context_management", "context_management is not supported"),
)

router = APIRouter()


@router.post("/v1/responses", response_model=ResponseObject, responses=_ERRORS)
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = server_state(request)
    model = state.check_model(body.model)
    _check_refused(body)
    chat = chat_request(body)
    response_id = f"resp_{uuid.uuid4().hex}"
    shell = response_shell(body, response_id, int(time.time()), model)
    tokenizer = state.engine.tokenizer

    def stream_events(generation: Generation, inputs: EngineInputs) -> AsyncIterator[str]:
        return _events(generation, inputs, ResponseEventStream(shell), tokenizer)

    def respond(outputs: list[RequestOutput], inputs: EngineInputs) -> ResponseObject:
        return _whole(shell, outputs[0], inputs, tokenizer)

    try:
        return await run_generation(request, state, chat, chat_inputs, response_id,
                                    stream_events, respond)
    except OpenAIError as error:
        raise responses_error(error) from error


def _check_refused(body: ResponsesRequest) -> None:
    """400 naming the first field set to something this server cannot do."""
    extra = body.model_extra or {}
    for entry in _REFUSED:
        if not entry.is_neutral(extra.get(entry.field)):
            raise bad_request(entry.reason, entry.field)


def _whole(shell: ResponseObject, output: RequestOutput, inputs: EngineInputs,
           tokenizer: Any) -> ResponseObject:
    assert inputs.output_parser is not None
    completion = output.outputs[0]
    parsed = inputs.output_parser.read(completion.text)
    is_cut = completion.finish_reason == "length"
    usage = responses_usage(chat_usage([output]), _num_tokens(tokenizer, parsed.reasoning))
    return finished_response(shell, output_items(parsed, is_cut), is_cut, usage)


async def _events(generation: Generation, inputs: EngineInputs, stream: ResponseEventStream,
                  tokenizer: Any) -> AsyncIterator[str]:
    """The response's events as the engine's DELTA outputs arrive, read by the chat plan's
    output reader; a failed engine ends the stream with `response.failed`."""
    assert inputs.output_parser is not None
    reader = inputs.output_parser.streamer()
    is_cut = False
    try:
        for event in stream.start():
            yield event
        async for _, output in generation.outputs():
            for completion in output.outputs:
                pieces = [reader.feed(completion.text)]
                if completion.finish_reason is not None:
                    pieces.append(reader.finish())
                    is_cut = completion.finish_reason == "length"
                for event in (event for piece in pieces for event in stream.feed(piece)):
                    yield event
        usage = chat_usage(generation.final_outputs(), generation.num_completion_tokens)
        num_reasoning = _num_tokens(tokenizer, stream.reasoning)
        for event in stream.finish(is_cut, responses_usage(usage, num_reasoning)):
            yield event
    except (EngineError, EngineClosedError) as error:
        for event in stream.fail(engine_failure(error).message):
            yield event
    finally:
        generation.close()


def _num_tokens(tokenizer: Any, text: str | None) -> int:
    if not text or tokenizer is None:
        return 0
    return len(tokenizer.encode(text, add_special_tokens=False))

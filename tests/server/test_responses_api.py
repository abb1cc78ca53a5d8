"""OpenAI's Responses API (`POST /v1/responses`) over real HTTP with the official client's
`client.responses.create` and `client.responses.stream`: the same greedy text as the same
conversation over /v1/chat/completions, streamed events the client parses into its typed
classes (and that validate against them), structured outputs, tool calls and a round trip,
cached tokens, an `incomplete` response, a reasoning item, and the 400s that name the field."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
from openai.types.responses import (
    Response,
    ResponseCompletedEvent,
    ResponseContentPartAddedEvent,
    ResponseContentPartDoneEvent,
    ResponseCreatedEvent,
    ResponseFailedEvent,
    ResponseFunctionCallArgumentsDeltaEvent,
    ResponseFunctionCallArgumentsDoneEvent,
    ResponseIncompleteEvent,
    ResponseInProgressEvent,
    ResponseOutputItemAddedEvent,
    ResponseOutputItemDoneEvent,
    ResponseReasoningTextDeltaEvent,
    ResponseReasoningTextDoneEvent,
    ResponseTextDeltaEvent,
    ResponseTextDoneEvent,
)

from kvpool.server import responses_api_routes
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, RunningServer, serve, thinks_then_answers
from tests.server.test_structured_http import PERSON_SCHEMA
from tests.server.test_tools import WEATHER_PARAMETERS

GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0}
QUESTION = "What is the capital of France? Answer with one word."
TOOL = {"type": "function", "name": "get_weather", "description": "The weather now in a city",
        "parameters": WEATHER_PARAMETERS}
ASK_WEATHER = "What is the weather in Paris right now?"
TEXT_EVENTS = [ResponseOutputItemAddedEvent, ResponseContentPartAddedEvent, ResponseTextDeltaEvent,
               ResponseTextDoneEvent, ResponseContentPartDoneEvent, ResponseOutputItemDoneEvent]


def checked(event: Any) -> Any:
    """The client parsed `event` into a typed class; it also validates against that class
    (the client only constructs, so a missing required field would otherwise pass)."""
    assert type(event).__module__.startswith("openai.types.responses"), type(event)
    type(event).model_validate(event.to_dict())
    return event


def stream_events(client: openai.OpenAI, **options: Any) -> list[Any]:
    events = [checked(event) for event in client.responses.create(stream=True, **options)]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    return events


def kinds(events: list[Any]) -> list[type]:
    """The event classes in order, with runs of one class (deltas) shown once."""
    classes = [type(event) for event in events]
    return [kind for index, kind in enumerate(classes) if index == 0 or classes[index - 1] != kind]


def chat_text(client: openai.OpenAI, messages: list[dict[str, Any]], **options: Any) -> str:
    reply = client.chat.completions.create(messages=messages, **GREEDY, **options)
    return reply.choices[0].message.content or ""


@pytest.fixture(scope="module")
def client(server: RunningServer) -> Iterator[openai.OpenAI]:
    yield server.client()


# ------------------------------------------------------------------ text
def test_text_input_is_the_chat_routes_greedy_text(client) -> None:
    response = client.responses.create(input=QUESTION, max_output_tokens=16, **GREEDY)
    Response.model_validate(response.to_dict())
    chat = client.chat.completions.create(messages=[{"role": "user", "content": QUESTION}],
                                          max_completion_tokens=16, **GREEDY)
    assert response.output_text == chat.choices[0].message.content
    assert response.id.startswith("resp_") and response.object == "response"
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.usage.total_tokens == chat.usage.total_tokens
    assert response.usage.output_tokens_details.reasoning_tokens == 0


def test_a_stream_sends_the_typed_events_in_order_and_joins_to_the_whole_text(client) -> None:
    options = {"input": QUESTION, "max_output_tokens": 16, "metadata": {"run": "a"}, **GREEDY}
    whole = client.responses.create(**options)
    events = stream_events(client, **options)
    assert whole.status == "completed"
    assert kinds(events) == [ResponseCreatedEvent, ResponseInProgressEvent, *TEXT_EVENTS,
                             ResponseCompletedEvent]
    assert "".join(e.delta for e in events if isinstance(e, ResponseTextDeltaEvent)) == (
        whole.output_text)
    final = events[-1].response
    assert final.output_text == whole.output_text and final.metadata == {"run": "a"}
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert final.output[0].id == events[2].item.id == events[-2].item.id
    assert final.usage.output_tokens == whole.usage.output_tokens
    with client.responses.stream(**options) as stream:
        helper_text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == helper_text == whole.output_text


def test_instructions_and_message_items_are_the_chat_conversation(client) -> None:
    items = [
        {"role": "user", "content": "Hello!"},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Hi. How can I help?"}]},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "What is two plus "},
                     {"type": "input_text", "text": "two?"}]},
    ]
    response = client.responses.create(instructions="You are terse.", input=items,
                                       max_output_tokens=12, **GREEDY)
    messages = [{"role": "system", "content": "You are terse."}, items[0],
                {"role": "assistant", "content": "Hi. How can I help?"},
                {"role": "user", "content": "What is two plus two?"}]
    assert response.output_text == chat_text(client, messages, max_completion_tokens=12)
    assert response.instructions == "You are terse."


def test_max_output_tokens_makes_the_response_incomplete(client) -> None:
    options = {"input": "Write a long story about a dragon.", "max_output_tokens": 3, **GREEDY}
    response = client.responses.create(**options)
    assert (response.status, response.incomplete_details.reason) == ("incomplete",
                                                                     "max_output_tokens")
    assert response.output[-1].status == "incomplete"
    assert response.usage.output_tokens == 3
    events = stream_events(client, **options)
    assert isinstance(events[-1], ResponseIncompleteEvent)
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-2].item.status == "incomplete"


def test_a_repeated_long_prompt_reads_cached_tokens(client) -> None:
    prompt = " ".join(f"Line {number}: the pool keeps blocks of keys and values."
                      for number in range(24)) + " Summarise."
    first = client.responses.create(input=prompt, max_output_tokens=1, **GREEDY)
    second = client.responses.create(input=prompt, max_output_tokens=1, **GREEDY)
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached > first.usage.input_tokens_details.cached_tokens
    assert second.usage.input_tokens - cached < 32  # all but the last, partial blocks


# ------------------------------------------------------------------ structured outputs
def test_json_schema_format_holds(client) -> None:
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA,
                       "strict": True}}
    response = client.responses.create(input="A person, as JSON.", text=text,
                                       max_output_tokens=60, **GREEDY)
    assert response.status == "completed"
    jsonschema.validate(json.loads(response.output_text), PERSON_SCHEMA)
    assert response.text.format.type == "json_schema"


# ------------------------------------------------------------------ tools
def test_tool_choice_required_returns_a_function_call(client) -> None:
    response = client.responses.create(input=ASK_WEATHER, tools=[TOOL], tool_choice="required",
                                       max_output_tokens=60, **GREEDY)
    calls = [item for item in response.output if item.type == "function_call"]
    assert calls and all(call.name == "get_weather" for call in calls)
    assert all(call.call_id.startswith("call_") for call in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_a_named_function_call_streams_to_the_whole_call(client) -> None:
    options = {"input": ASK_WEATHER, "tools": [TOOL], "max_output_tokens": 60,
               "tool_choice": {"type": "function", "name": "get_weather"}, **GREEDY}
    whole = client.responses.create(**options)
    assert [item.type for item in whole.output] == ["function_call"]
    arguments = whole.output[0].arguments
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    events = stream_events(client, **options)
    assert kinds(events) == [
        ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent,
        ResponseFunctionCallArgumentsDeltaEvent, ResponseFunctionCallArgumentsDoneEvent,
        ResponseOutputItemDoneEvent, ResponseCompletedEvent]
    deltas = [e.delta for e in events if isinstance(e, ResponseFunctionCallArgumentsDeltaEvent)]
    assert "".join(deltas) == events[-3].arguments == arguments
    assert events[-1].response.output[0].call_id == events[2].item.call_id


def test_a_tool_round_trip_is_the_chat_round_trip(client) -> None:
    first = client.responses.create(
        input=ASK_WEATHER, tools=[TOOL], tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60, **GREEDY)
    call = first.output[0]
    result = '{"temperature": 21, "sky": "clear"}'
    items = [{"role": "user", "content": ASK_WEATHER},
             *(item.to_dict() for item in first.output),
             {"type": "function_call_output", "call_id": call.call_id, "output": result}]
    answer = client.responses.create(input=items, tools=[TOOL], max_output_tokens=16, **GREEDY)
    messages = [
        {"role": "user", "content": ASK_WEATHER},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.call_id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": result},
    ]
    tools = [{"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}]
    assert answer.output_text == chat_text(client, messages, tools=tools,
                                           max_completion_tokens=16)


# ------------------------------------------------------------------ reasoning
SUM_SCHEMA = {"type": "object", "required": ["sum"], "additionalProperties": False,
              "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 99}}}


def test_thinking_is_a_reasoning_item_before_the_message(fast_model, monkeypatch) -> None:
    """The random model is driven to think and then answer (`thinks_then_answers`' fields,
    added here to the chat request the response becomes: the Responses API has no
    `logit_bias`); the schema holds the answer after the thinking."""
    forcing = thinks_then_answers(fast_model.tokenizer, '{"sum":4}')
    translate = responses_api_routes.chat_request
    monkeypatch.setattr(responses_api_routes, "chat_request",
                        lambda body: translate(body).model_copy(update=forcing))
    config = ServerConfig(served_model_names=(MODEL,), reasoning_parser="qwen3")
    text_format = {"type": "json_schema", "name": "sum", "schema": SUM_SCHEMA}
    options = {"input": "What is two and two?", "max_output_tokens": 40,
               "text": {"format": text_format}, **GREEDY}
    with serve(fast_model, config, num_gpu_blocks=64) as server:
        client = server.client()
        whole = client.responses.create(**options)
        events = stream_events(client, **options)
    reasoning, message = whole.output
    assert (reasoning.type, message.type) == ("reasoning", "message")
    thinking = reasoning.content[0].text
    assert thinking == "think"
    jsonschema.validate(json.loads(whole.output_text), SUM_SCHEMA)
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens < whole.usage.output_tokens
    assert kinds(events) == [
        ResponseCreatedEvent, ResponseInProgressEvent, ResponseOutputItemAddedEvent,
        ResponseContentPartAddedEvent, ResponseReasoningTextDeltaEvent,
        ResponseReasoningTextDoneEvent, ResponseContentPartDoneEvent,
        ResponseOutputItemDoneEvent, *TEXT_EVENTS, ResponseCompletedEvent]
    streamed = "".join(e.delta for e in events if isinstance(e, ResponseReasoningTextDeltaEvent))
    assert streamed == thinking
    assert events[-1].response.output_text == whole.output_text


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(("options", "param"), [
    ({"previous_response_id": "resp_0"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"conversation": "conv_0"}, "conversation"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0]"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
     "input[0].content[0]"),
    ({"input": "word " * 40_000}, "input"),
    ({"max_output_tokens": 10**8}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}}},
     "text.format.schema"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name"),
    ({"input": None}, "input"),
])
def test_what_cannot_be_served_is_a_400_naming_the_field(client, options, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(**{"input": QUESTION, "max_output_tokens": 1, **GREEDY,
                                   **options})
    assert refused.value.param == param


def test_store_false_is_accepted(client) -> None:
    response = client.responses.create(input=QUESTION, store=False, max_output_tokens=1,
                                       **GREEDY)
    assert response.status == "incomplete"


def _fail_next_step(server: RunningServer) -> None:
    runner = server.engine.engine.runner
    execute = runner.execute

    def failing_execute(*args: Any, **kwargs: Any) -> Any:
        runner.execute = execute  # only this step fails
        raise RuntimeError("injected failure")

    runner.execute = failing_execute


def test_a_failing_engine_step_is_a_500_or_a_failed_stream(server, client) -> None:
    _fail_next_step(server)
    with pytest.raises(openai.InternalServerError, match="engine failed"):
        client.responses.create(input=QUESTION, max_output_tokens=4, **GREEDY)
    _fail_next_step(server)
    events = stream_events(client, input=QUESTION, max_output_tokens=4, **GREEDY)
    assert kinds(events) == [ResponseCreatedEvent, ResponseInProgressEvent, ResponseFailedEvent]
    failed = events[-1].response
    assert (failed.status, failed.error.code) == ("failed", "server_error")
    assert client.responses.create(input=QUESTION, max_output_tokens=4, **GREEDY).output_text

"""Anthropic's Messages API (/v1/messages) over real HTTP with the official `anthropic` client:
text, the stream's event sequence, system and multi-turn conversations answered as
/v1/chat/completions answers them, stop sequences, tool choices held to the schema (whole and
streamed), a tool round trip, the prefix cache in usage, count_tokens, thinking blocks under a
reasoning parser, and every error in Anthropic's shape (x-api-key auth included)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from kvpool.anthropic.convert import chat_request, content_blocks
from kvpool.anthropic.protocol import MessagesRequest, TextBlock, ThinkingBlock, ToolUseBlock
from kvpool.openai.auth import ApiKeyTable
from kvpool.openai.tools.parser import ParsedOutput, ParsedToolCall
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, RunningServer, serve
from tests.server.test_tools import WEATHER_PARAMETERS

KEY = "key-messages"
MAX_REQUEST_BYTES = 64 * 1024
ASK = [{"role": "user", "content": "What is the capital of France?"}]
WEATHER_SCHEMA = WEATHER_PARAMETERS
TIME_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}},
               "required": ["city"]}
TOOLS = [
    {"name": "get_weather", "description": "The weather now in a city",
     "input_schema": WEATHER_SCHEMA},
    {"name": "get_time", "description": "The local time in a city", "input_schema": TIME_SCHEMA},
]
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in TOOLS}
WEATHER_ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
RAW_EVENTS = {"message_start", "content_block_start", "content_block_delta",
              "content_block_stop", "message_delta", "message_stop"}
DELTA_OF = {"text": "text_delta", "tool_use": "input_json_delta", "thinking": "thinking_delta"}


@pytest.fixture(scope="module")
def server(smollm2) -> Iterator[RunningServer]:
    config = ServerConfig(served_model_names=(MODEL,), max_request_bytes=MAX_REQUEST_BYTES,
                          api_keys=ApiKeyTable.from_keys([("default", KEY)]))
    with serve(smollm2, config, num_gpu_blocks=128) as running:
        yield running


def messages_client(server: RunningServer, key: str = KEY) -> anthropic.Anthropic:
    """The official client sending `key` as `x-api-key` only. (This client release sends an
    `api_key` as `Authorization: Bearer`; the header is left out so x-api-key is tested.)"""
    headers = {"x-api-key": key, "Authorization": anthropic.Omit()}
    return anthropic.Anthropic(base_url=server.base_url, api_key="not-sent", max_retries=0,
                               timeout=120, default_headers=headers)


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return messages_client(server)


GREEDY = {"model": MODEL, "extra_body": {"temperature": 0}}  # this client has no temperature


def create(client: anthropic.Anthropic, **options: Any) -> anthropic.types.Message:
    return client.messages.create(**GREEDY, **options)


def streamed(client: anthropic.Anthropic, **options: Any
             ) -> tuple[list[Any], anthropic.types.Message]:
    """The stream's raw events and the message the client assembles from them."""
    with client.messages.stream(**GREEDY, **options) as stream:
        events = [event for event in stream if event.type in RAW_EVENTS]
        return events, stream.get_final_message()


def block_types(events: list[Any]) -> list[str]:
    """Checks Anthropic's order (message_start; per block a start, its deltas, a stop, with
    indices 0, 1, ...; message_delta; message_stop) and returns the blocks' types."""
    assert events[0].type == "message_start"
    assert [event.type for event in events[-2:]] == ["message_delta", "message_stop"]
    types: list[str] = []
    is_open = False
    for event in events[1:-2]:
        if event.type == "content_block_start":
            assert not is_open and event.index == len(types)
            types.append(event.content_block.type)
        else:
            assert is_open and event.index == len(types) - 1
        if event.type == "content_block_delta":
            assert event.delta.type == DELTA_OF[types[-1]]
        is_open = event.type != "content_block_stop"
    assert not is_open
    return types


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


# ------------------------------------------------------------------ text
def test_a_message_answers_with_a_text_block_and_usage(client) -> None:
    message = create(client, messages=ASK, max_tokens=16, metadata={"user_id": "u-1"})
    assert message.id.startswith("msg_") and message.model == MODEL
    assert message.role == "assistant" and message.type == "message"
    assert [block.type for block in message.content] == ["text"] and text_of(message)
    assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None
    usage = message.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 16
    assert usage.cache_creation_input_tokens == 0 and usage.cache_read_input_tokens is not None


def test_the_stream_sends_the_events_in_order_with_the_greedy_text(client) -> None:
    whole = create(client, messages=ASK, max_tokens=16)
    events, final = streamed(client, messages=ASK, max_tokens=16)
    assert block_types(events) == ["text"]
    deltas = [event.delta.text for event in events if event.type == "content_block_delta"]
    assert "".join(deltas) == text_of(final) == text_of(whole)
    assert final.stop_reason == whole.stop_reason
    assert events[-2].usage.output_tokens == whole.usage.output_tokens
    start = events[0].message
    assert start.id.startswith("msg_") and start.content == [] and start.usage.input_tokens > 0


def test_system_and_turns_answer_as_chat_completions_does(server, client) -> None:
    system = "You are a terse geography teacher."
    turns = [*ASK, {"role": "assistant", "content": "Paris."},
             {"role": "user", "content": [{"type": "text", "text": "And of "},
                                          {"type": "text", "text": "Italy?"}]}]
    message = create(client, system=[{"type": "text", "text": system}], messages=turns,
                     max_tokens=16)
    chat_turns = [{"role": "system", "content": system}, *turns[:2],
                  {"role": "user", "content": "And of Italy?"}]
    chat = server.client(api_key=KEY).chat.completions.create(
        model=MODEL, messages=chat_turns, max_tokens=16, temperature=0)
    assert text_of(message) == chat.choices[0].message.content
    assert message.usage.output_tokens == chat.usage.completion_tokens
    assert create(client, system=system, messages=turns, max_tokens=16).content == \
        message.content  # a system string is the one text block


def test_a_stop_sequence_ends_the_text_and_is_named(client) -> None:
    text = text_of(create(client, messages=ASK, max_tokens=24))
    stop = next(word for word in text.split()[1:] if len(word) >= 3)
    options = {"messages": ASK, "max_tokens": 24, "stop_sequences": ["#never#", stop]}
    message = create(client, **options)
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", stop)
    assert text_of(message) == text[: text.index(stop)]
    events, final = streamed(client, **options)
    assert (events[-2].delta.stop_reason, events[-2].delta.stop_sequence) == (
        "stop_sequence", stop)
    assert text_of(final) == text_of(message)


# ------------------------------------------------------------------ tools
def tool_uses(message: anthropic.types.Message) -> list[Any]:
    calls = [block for block in message.content if block.type == "tool_use"]
    for call in calls:
        assert call.id.startswith("toolu_")
        jsonschema.validate(call.input, SCHEMAS[call.name])
    return calls


@pytest.mark.parametrize("is_stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("tool_choice", [{"type": "any"},
                                         {"type": "tool", "name": "get_weather"}],
                         ids=["any", "tool"])
def test_a_tool_choice_gives_tool_use_blocks_that_validate(client, tool_choice, is_stream
                                                           ) -> None:
    options = {"messages": WEATHER_ASK, "tools": TOOLS, "tool_choice": tool_choice,
               "max_tokens": 120}
    if is_stream:
        events, message = streamed(client, **options)
        assert set(block_types(events)) == {"tool_use"}
        arguments = [""] * len(message.content)
        for event in events:
            if event.type == "content_block_delta":
                arguments[event.index] += event.delta.partial_json
        assert [json.loads(text) for text in arguments] == [
            block.input for block in message.content]
    else:
        message = create(client, **options)
    calls = tool_uses(message)
    assert calls and message.stop_reason == "tool_use"
    if tool_choice["type"] == "tool":
        assert [call.name for call in calls] == ["get_weather"]


def test_a_tool_round_trip_answers_from_the_result_as_chat_completions_does(
        server, client) -> None:
    call = {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
            "input": {"city": "Paris", "unit": "celsius"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1",
              "content": [{"type": "text", "text": '{"temperature": 21}'}]}
    turns = [*WEATHER_ASK, {"role": "assistant", "content": [call]},
             {"role": "user", "content": [result]}]
    message = create(client, messages=turns, tools=TOOLS, max_tokens=24)
    chat_turns = [*WEATHER_ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": "toolu_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps(call["input"])}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temperature": 21}'}]
    chat = server.client(api_key=KEY).chat.completions.create(
        model=MODEL, messages=chat_turns, max_tokens=24, temperature=0,
        tools=[{"type": "function", "function": {"name": tool["name"], "description":
                tool["description"], "parameters": tool["input_schema"]}} for tool in TOOLS])
    reply = chat.choices[0].message
    assert text_of(message) == (reply.content or "")
    assert [block.name for block in message.content if block.type == "tool_use"] == [
        call.function.name for call in reply.tool_calls or []]
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == \
        chat.usage.prompt_tokens


# ------------------------------------------------------------------ cache and counting
def test_a_repeated_long_prompt_reads_the_cache_and_count_tokens_agrees(client) -> None:
    system = "The lighthouse keeper logs every ship that passes the northern cape. " * 12
    options = {"system": system, "messages": ASK, "max_tokens": 2}
    first, again = create(client, **options), create(client, **options)
    num_prompt = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert first.usage.cache_read_input_tokens == 0
    assert again.usage.cache_read_input_tokens > 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == num_prompt
    counted = client.messages.count_tokens(model=MODEL, system=system, messages=ASK)
    assert counted.input_tokens == num_prompt
    events, _ = streamed(client, **options)
    assert events[0].message.usage.cache_read_input_tokens > 0  # message_start carries it


# ------------------------------------------------------------------ thinking
def test_thinking_comes_first_then_text_then_each_call() -> None:
    parsed = ParsedOutput("Paris is in France.", "It is Paris.",
                          [ParsedToolCall("get_time", '{"city": "Paris"}'),
                           ParsedToolCall("get_time", '{"city": "Par')])  # cut off: text
    blocks = content_blocks(parsed)
    assert blocks[:2] == [ThinkingBlock(thinking="Paris is in France.", signature=""),
                          TextBlock(text="It is Paris.")]
    assert isinstance(blocks[2], ToolUseBlock) and blocks[2].input == {"city": "Paris"}
    assert blocks[3] == TextBlock(text='{"city": "Par')
    assert content_blocks(ParsedOutput(None, None, [])) == []


@pytest.mark.parametrize(("thinking", "enabled"), [
    ({"type": "enabled", "budget_tokens": 1024}, True), ({"type": "disabled"}, False),
    (None, None)])
def test_thinking_reaches_the_chat_template_as_enable_thinking(thinking, enabled) -> None:
    body = {"model": MODEL, "max_tokens": 8, "messages": ASK}
    request = chat_request(MessagesRequest.model_validate(
        body if thinking is None else {**body, "thinking": thinking}))
    expected = None if enabled is None else {"enable_thinking": enabled}
    assert request.chat_template_kwargs == expected


def test_a_reasoning_server_answers_with_thinking_blocks_first(fast_model) -> None:
    """deepseek_r1's output thinks until it writes </think>, which a random model never does:
    all of it is a thinking block, the reasoning_content of the same chat completion."""
    config = ServerConfig(served_model_names=(MODEL,), reasoning_parser="deepseek_r1")
    options: dict[str, Any] = {"messages": ASK, "max_tokens": 12,
                               "thinking": {"type": "enabled", "budget_tokens": 1024}}
    with serve(fast_model, config, num_gpu_blocks=64) as running:
        client = anthropic.Anthropic(base_url=running.base_url, api_key="unused",
                                     max_retries=0, timeout=120)
        message = create(client, **options)
        events, final = streamed(client, **options)
        chat = running.client().chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=12, temperature=0)
    thinking = chat.choices[0].message.reasoning_content
    assert thinking and message.content[0].type == "thinking"
    assert (message.content[0].thinking, message.content[0].signature) == (thinking, "")
    assert [block.type for block in message.content] == ["thinking"]
    assert block_types(events) == ["thinking"]
    assert final.content[0].thinking == thinking


# ------------------------------------------------------------------ errors
def refused(client: anthropic.Anthropic, body: dict[str, Any],
            path: str = "/v1/messages") -> anthropic.APIStatusError:
    with pytest.raises(anthropic.APIStatusError) as caught:
        client.post(path, body=body, cast_to=anthropic.types.Message)
    return caught.value


def assert_shape(error: anthropic.APIStatusError, status: int, kind: str) -> str:
    assert error.status_code == status
    assert set(error.body) == {"type", "error"} and error.body["type"] == "error"
    assert set(error.body["error"]) == {"type", "message"} and error.body["error"]["type"] == kind
    return error.body["error"]["message"]


BLOCK = {"type": "text", "text": "hi"}
BAD_BODIES = {
    "missing max_tokens": ({"messages": ASK}, "max_tokens: Field required"),
    "unknown tool in tool_choice": ({"messages": ASK, "max_tokens": 4, "tools": TOOLS,
                                     "tool_choice": {"type": "tool", "name": "get_news"}},
                                    "tool_choice.name:"),
    "content block without its text": ({"messages": [{"role": "user", "content": [
        {"type": "text"}]}], "max_tokens": 4}, "messages.0.content.0"),
    "image block": ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}], "max_tokens": 4}, "'image'"),
    "server tool": ({"messages": ASK, "max_tokens": 4, "tools": [
        {"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
    "tool_use in a user turn": ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "get_time", "input": {}}]}], "max_tokens": 4},
                                "messages.0.content: tool_use blocks belong in assistant"),
    "more than the context": ({"messages": [{"role": "user", "content": "lighthouse " * 3000}],
                               "max_tokens": 4}, "messages: the prompt has"),
    "max_tokens over the context": ({"messages": ASK, "max_tokens": 10**6}, "max_tokens"),
}


@pytest.mark.parametrize("case", list(BAD_BODIES))
def test_a_bad_request_is_an_anthropic_400(client, case: str) -> None:
    body, message_start = BAD_BODIES[case]
    error = refused(client, {"model": MODEL, **body})
    assert isinstance(error, anthropic.BadRequestError)
    assert message_start in assert_shape(error, 400, "invalid_request_error")


def test_other_errors_have_anthropic_types_and_statuses(server, client) -> None:
    oversized = {"model": MODEL, "max_tokens": 4,
                 "messages": [{"role": "user", "content": "x" * MAX_REQUEST_BYTES}]}
    assert_shape(refused(client, oversized), 413, "request_too_large")
    unknown = refused(client, {"model": "claude-nope", "max_tokens": 4, "messages": ASK})
    assert isinstance(unknown, anthropic.NotFoundError)
    assert_shape(unknown, 404, "not_found_error")
    counted = refused(client, {"model": MODEL, "messages": [{"role": "user"}]},
                      "/v1/messages/count_tokens")
    assert_shape(counted, 400, "invalid_request_error")
    with pytest.raises(openai.BadRequestError) as chat:  # other paths keep OpenAI's shape
        server.client(api_key=KEY).chat.completions.create(model=MODEL, messages=[])
    assert chat.value.body["code"] == 400


def test_keys_go_in_x_api_key_or_bearer_on_every_route(server) -> None:
    with pytest.raises(anthropic.AuthenticationError) as wrong:
        create(messages_client(server, "key-wrong"), messages=ASK, max_tokens=2)
    assert "incorrect API key" in assert_shape(wrong.value, 401, "authentication_error")
    bearer = anthropic.Anthropic(base_url=server.base_url, api_key=KEY, max_retries=0)
    assert bearer.messages.count_tokens(model=MODEL, messages=ASK).input_tokens > 0
    with httpx.Client(base_url=server.base_url) as http:
        assert http.get("/v1/models", headers={"x-api-key": KEY}).status_code == 200
        missing = http.post("/v1/messages", json={"model": MODEL, "messages": ASK})
        openai_shaped = http.get("/v1/models", headers={"x-api-key": "key-wrong"})
    assert missing.status_code == 401 and "x-api-key" in missing.json()["error"]["message"]
    assert openai_shaped.json()["error"]["code"] == 401

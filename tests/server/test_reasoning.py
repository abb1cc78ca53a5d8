"""Reasoning parsers (`--reasoning-parser`): thinking split from the answer, whole and streamed
alike (any way the text is cut), tool calls read from the answer after it, and over real HTTP
with the official client: `reasoning_content` in messages and in streamed deltas, and a
constraint (a JSON schema, a tool choice) that holds only the answer after the thinking."""

from __future__ import annotations

import json
from itertools import pairwise
from typing import Any

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvpool.cli import build_parser
from kvpool.cli.serve import server_config_from_args
from kvpool.openai.reasoning import ThinkingFirst, get_reasoning_parser
from kvpool.openai.tools import get_tool_parser
from kvpool.openai.tools.output import PlainOutput
from kvpool.openai.tools.parser import ParsedOutput, ParsedToolCall, read_pieces
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, serve, thinks_then_answers

# (parser, output text, (reasoning, content)) as a model would write them.
RECORDED = [
    ("deepseek_r1", "Two and two.</think>\n\nIt is 4.", ("Two and two.", "\n\nIt is 4.")),
    ("deepseek_r1", "<think>Two and two.</think>It is 4.", ("Two and two.", "It is 4.")),
    ("deepseek_r1", "Still thinking when cut off", ("Still thinking when cut off", None)),
    ("deepseek_r1", "</think>", (None, None)),
    ("qwen3", "<think>\nTwo and two.\n</think>\n\nIt is 4.", ("\nTwo and two.\n", "\n\nIt is 4.")),
    ("qwen3", "It is 4.", (None, "It is 4.")),  # enable_thinking false: no tags
    ("qwen3", "<think>cut off inside </thi", ("cut off inside </thi", None)),
    ("qwen3", "<thin", (None, "<thin")),  # a tag never finished is text
]


def plain(name: str) -> ThinkingFirst:
    return ThinkingFirst(get_reasoning_parser(name), PlainOutput())


@pytest.mark.parametrize(("name", "text", "expected"), RECORDED)
def test_recorded_outputs_split_into_thinking_and_answer(name, text, expected) -> None:
    parsed = plain(name).read(text)
    assert (parsed.reasoning, parsed.content) == expected


@given(st.sampled_from(RECORDED), st.lists(st.integers(0, 60), max_size=6))
def test_a_stream_cut_anywhere_reads_as_the_whole_text(recorded, cuts) -> None:
    name, text, _ = recorded
    parser = plain(name)
    bounds = sorted({0, len(text), *(cut % (len(text) + 1) for cut in cuts)})
    streamer = parser.streamer()
    pieces = [streamer.feed(text[start:end]) for start, end in pairwise(bounds)]
    assert read_pieces([*pieces, streamer.finish()]) == parser.read(text)


def test_tool_calls_are_read_from_the_answer_after_the_thinking() -> None:
    parser = ThinkingFirst(get_reasoning_parser("qwen3"), get_tool_parser("hermes"))
    text = ('<think>The user wants the weather: call the tool. <tool_call> is how.</think>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>')
    assert parser.read(text) == ParsedOutput(
        "The user wants the weather: call the tool. <tool_call> is how.", None,
        [ParsedToolCall("get_weather", '{"city": "Oslo"}')])


def test_an_unknown_reasoning_parser_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"unknown reasoning parser 'o1'.*deepseek_r1, qwen3"):
        ServerConfig(served_model_names=(MODEL,), reasoning_parser="o1")
    args = build_parser().parse_args(["serve", "--reasoning-parser", "qwen3"])
    assert server_config_from_args(args).reasoning_parser == "qwen3"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--reasoning-parser", "o1"])


# ---------------------------------------------------------------- over HTTP
ASK = [{"role": "user", "content": "What is two and two?"}]
SUM_SCHEMA = {"type": "object", "required": ["sum"], "additionalProperties": False,
              "properties": {"sum": {"type": "integer", "minimum": 0, "maximum": 99}}}
SUM_FORMAT = {"type": "json_schema", "json_schema": {"name": "sum", "schema": SUM_SCHEMA}}
ADD_PARAMETERS = {"type": "object", "required": ["exact"],
                  "properties": {"exact": {"type": "boolean"}}}
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": ADD_PARAMETERS}}


def thinking_first(fast_model, answer: str = "", opens: bool = True) -> dict[str, Any]:
    """The official client's arguments of `thinks_then_answers`' fields."""
    fields = thinks_then_answers(fast_model.tokenizer, answer, opens)
    return {"logit_bias": fields["logit_bias"], "extra_body": {"bad_words": fields["bad_words"]}}


def reasoning_server(fast_model, name: str):
    return serve(fast_model, ServerConfig(served_model_names=(MODEL,), reasoning_parser=name),
                 num_gpu_blocks=64)


def streamed(chunks) -> tuple[str, str]:
    thinking = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                       for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return thinking, content


def schema_request(fast_model, **forcing) -> dict[str, Any]:
    forced = thinking_first(fast_model, '{"sum":4}', **forcing)
    return {"model": MODEL, "messages": ASK, "max_completion_tokens": 40, "temperature": 0,
            "response_format": SUM_FORMAT, **forced}


def test_deepseek_r1_schema_holds_the_answer_after_the_thinking(fast_model) -> None:
    """The output thinks freely (`think` is no JSON), then its answer matches the schema,
    streamed or not; one that never closes its thinking is all reasoning, never held."""
    options = schema_request(fast_model)
    with reasoning_server(fast_model, "deepseek_r1") as server:
        client = server.client()
        choice = client.chat.completions.create(**options).choices[0]
        assert choice.message.reasoning_content == "think"
        jsonschema.validate(json.loads(choice.message.content), SUM_SCHEMA)
        assert choice.finish_reason == "stop"
        assert streamed(list(client.chat.completions.create(stream=True, **options))) == (
            "think", choice.message.content)
        unforced = {**options, "logit_bias": None, "extra_body": {},
                    "max_completion_tokens": 12}
        choice = client.chat.completions.create(**unforced).choices[0]
        assert choice.message.reasoning_content and choice.message.content is None
        assert choice.finish_reason == "length"


def test_qwen3_thinks_only_if_it_opens_with_the_tag_and_the_schema_holds_the_answer(
        fast_model) -> None:
    """Opened with <think>, the thinking goes to reasoning_content and the answer matches the
    schema; not opened, the schema holds from the first token and all is answer, as it is
    for an unconstrained reply of a model that writes no tags."""
    options = schema_request(fast_model)
    with reasoning_server(fast_model, "qwen3") as server:
        client = server.client()
        message = client.chat.completions.create(**options).choices[0].message
        assert message.reasoning_content == "think"
        jsonschema.validate(json.loads(message.content), SUM_SCHEMA)
        assert streamed(list(client.chat.completions.create(stream=True, **options))) == (
            "think", message.content)
        unopened = client.chat.completions.create(**schema_request(fast_model, opens=False))
        message = unopened.choices[0].message
        assert message.reasoning_content is None
        jsonschema.validate(json.loads(message.content), SUM_SCHEMA)
        plain_reply = client.chat.completions.create(
            model=MODEL, messages=ASK, max_completion_tokens=20, temperature=0).choices[0]
        assert plain_reply.message.reasoning_content is None and plain_reply.message.content


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function",
                                                      "function": {"name": "add"}}],
                         ids=["required", "named"])
def test_tool_choice_calls_are_read_after_the_thinking(fast_model, tool_choice) -> None:
    options: dict[str, Any] = {
        "model": MODEL, "messages": ASK, "max_completion_tokens": 40, "temperature": 0,
        "tools": [ADD_TOOL], "tool_choice": tool_choice, "parallel_tool_calls": False,
        **thinking_first(fast_model, '{"exact":true}')}
    with reasoning_server(fast_model, "deepseek_r1") as server:
        choice = server.client().chat.completions.create(**options).choices[0]
    message = choice.message
    assert message.reasoning_content == "think" and not message.content
    (call,) = message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD_PARAMETERS)
    assert choice.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")


def test_deepseek_r1_output_is_thinking_until_it_closes(fast_model) -> None:
    """The template opened the thinking in the prompt: an output that never writes
    </think> (a random model's) is all reasoning, streamed or not, and is the text a server
    without the parser answers."""
    options: dict[str, Any] = {"model": MODEL, "messages": ASK, "max_completion_tokens": 12,
                               "temperature": 0}
    with serve(fast_model, num_gpu_blocks=64) as server:
        text = server.client().chat.completions.create(**options).choices[0].message.content
    with reasoning_server(fast_model, "deepseek_r1") as server:
        client = server.client()
        message = client.chat.completions.create(**options).choices[0].message
        assert (message.reasoning_content, message.content) == (text, None)
        assert streamed(list(client.chat.completions.create(stream=True, **options))) == (
            text, "")

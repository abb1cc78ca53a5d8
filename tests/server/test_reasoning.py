"""Reasoning parsers (`--reasoning-parser`): thinking split from the answer, whole and streamed
alike (any way the text is cut), tool calls read from the answer after it, and over real HTTP
with the official client: `reasoning_content` in messages and in streamed deltas."""

from __future__ import annotations

import re
from itertools import pairwise
from typing import Any

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
from tests.server.conftest import MODEL, serve

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
# Holds a random-weight model to a thinking-then-answer reply, so the parser reads real output.
THINK_REGEX = r"<think>[a-z ]{4,16}</think>[A-Z][a-z ]{2,10}\."


def reasoning_server(fast_model, name: str):
    return serve(fast_model, ServerConfig(served_model_names=(MODEL,), reasoning_parser=name),
                 num_gpu_blocks=64)


def streamed(chunks) -> tuple[str, str]:
    thinking = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                       for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return thinking, content


def test_qwen3_thinking_goes_to_reasoning_content_streamed_or_not(fast_model) -> None:
    options: dict[str, Any] = {
        "model": MODEL, "messages": ASK, "max_completion_tokens": 60, "temperature": 0,
        "extra_body": {"structured_outputs": {"regex": THINK_REGEX}}}
    with reasoning_server(fast_model, "qwen3") as server:
        client = server.client()
        message = client.chat.completions.create(**options).choices[0].message
        thinking, content = message.reasoning_content, message.content
        assert re.fullmatch(THINK_REGEX, f"<think>{thinking}</think>{content}")
        assert streamed(list(client.chat.completions.create(stream=True, **options))) == (
            thinking, content)
        plain_reply = client.chat.completions.create(
            **{**options, "extra_body": {}}).choices[0].message  # no tags: all answer
        assert plain_reply.reasoning_content is None and plain_reply.content


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

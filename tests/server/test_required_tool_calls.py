"""`tool_choice: "required"` (and LangChain's `"any"`) always ends with parsed calls: the
format is a bounded array of calls with fixed separators, then only the stop token
(`kvpool.openai.tools.required_calls`).

The HTTP case is one the real SmolLM2 got wrong under greedy decoding before: with one
parameterless tool and a question it does not answer, it wrote call after call (with
newlines between) until `max_tokens`, so no `tool_calls` came back."""

from __future__ import annotations

import json

import pytest
import xgrammar
from xgrammar.testing import _is_grammar_accept_string

from kvpool.openai.protocol import ToolDefinition
from kvpool.openai.tools.required_calls import MAX_REQUIRED_CALLS, required_calls_grammar
from tests.server.conftest import MODEL

GET_TIME = {"type": "function", "function": {"name": "get_time",
                                             "description": "The current UTC time"}}
BOSTON = [{"role": "user", "content": "What's the weather like in Boston today?"}]
MAX_TOKENS = 200


def _accepts(grammar: str, text: str) -> bool:
    return _is_grammar_accept_string(xgrammar.Grammar.from_ebnf(grammar), text)


def _calls(num_calls: int) -> str:
    return "[" + ", ".join(['{"name": "get_time", "parameters": {}}'] * num_calls) + "]"


def test_the_grammar_bounds_the_calls_and_the_whitespace() -> None:
    tools = [ToolDefinition.model_validate(GET_TIME)]
    grammar = required_calls_grammar(tools, is_parallel=True)
    assert _accepts(grammar, _calls(1))
    assert _accepts(grammar, _calls(MAX_REQUIRED_CALLS))
    assert not _accepts(grammar, _calls(MAX_REQUIRED_CALLS + 1))
    assert not _accepts(grammar, "[]")
    assert not _accepts(grammar, "\n" + _calls(1))
    assert not _accepts(grammar, _calls(1) + "\n")
    assert not _accepts(grammar, '[{"name": "get_time",\n "parameters": {}}]')
    single = required_calls_grammar(tools, is_parallel=False)
    assert _accepts(single, _calls(1))
    assert not _accepts(single, _calls(2))


@pytest.mark.parametrize("tool_choice", ["required", "any"])
def test_required_and_any_end_with_parsed_calls(server, tool_choice: str) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL, messages=BOSTON, tools=[GET_TIME], tool_choice=tool_choice,
        max_completion_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert reply.usage.completion_tokens < MAX_TOKENS
    calls = choice.message.tool_calls
    assert 1 <= len(calls) <= MAX_REQUIRED_CALLS
    for call in calls:
        assert call.function.name == "get_time"
        assert json.loads(call.function.arguments) == {}


def test_parallel_tool_calls_false_ends_after_one_call(server) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL, messages=BOSTON, tools=[GET_TIME], tool_choice="any",
        parallel_tool_calls=False, max_completion_tokens=MAX_TOKENS, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"

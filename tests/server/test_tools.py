"""Tool calling on /v1/chat/completions: the Hermes parser (whole and streamed agree), the
prompt the tools are rendered into, `tool_choice` none / auto / required / a named function
over real HTTP, a call → result → answer round trip, streamed tool-call deltas reassembling
to the non-streamed calls, the 400s, and the `kvpool serve` flags."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from kvpool.cli import build_parser
from kvpool.cli.serve import server_config_from_args
from kvpool.openai.protocol import ChatCompletionRequest
from kvpool.openai.tools import get_tool_parser
from kvpool.openai.tools.choice import plan_tools
from kvpool.openai.tools.parser import assemble
from kvpool.openai.tools.prompt import conversation, template_takes_tools
from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, serve

WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 24},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now "
                                      "in a city", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "maxLength": 24}},
                                          "required": ["city"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
CHAT = "/v1/chat/completions"
# Forces an auto-mode reply in the Hermes syntax, so the parser runs on real output.
HERMES_REGEX = (r'Sure\.<tool_call>\{"name": "get_weather", "arguments": \{"city": '
                r'"(Paris|Rome)", "unit": "celsius"\}\}</tool_call>')


# ------------------------------------------------------------------ the parser
HERMES_TEXTS = [
    "no call at all",
    'Let me look.<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>',
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", '
    '"arguments": {"a": "é"}}</tool_call>',
    '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool',  # cut inside the end tag
    "<tool_call>not json</tool_call> so all of it is content",
    "ends with a partial tag <tool_",
]


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_streamed_character_by_character_equals_the_whole_parse(text: str) -> None:
    parser = get_tool_parser("hermes")
    streamer = parser.streamer()
    pieces = [streamer.feed(char) for char in text] + [streamer.finish()]
    assert assemble(pieces) == parser.extract(text)


def test_hermes_reads_content_and_calls() -> None:
    content, calls = get_tool_parser("hermes").extract(HERMES_TEXTS[1])
    assert content == "Let me look."
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [("f", {"x": 1})]
    content, calls = get_tool_parser("hermes").extract(HERMES_TEXTS[4])
    assert (content, calls) == (HERMES_TEXTS[4], [])


def test_an_unknown_parser_name_is_refused() -> None:
    with pytest.raises(ValueError, match="known: hermes"):
        ServerConfig(tool_call_parser="nope")


# ------------------------------------------------------------------ the prompt
HISTORY = [
    {"role": "system", "content": "You are terse."},
    *ASK,
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'},
]


def test_a_template_without_tools_gets_the_default_tool_prompt(smollm2) -> None:
    request = ChatCompletionRequest.model_validate({"messages": HISTORY, "tools": TOOLS})
    template = smollm2.tokenizer.hf_tokenizer.chat_template
    assert not template_takes_tools(template)
    messages, extra = conversation(request.messages, plan_tools(request), template)
    assert extra == {}
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    system = messages[0]["content"]
    assert system.startswith("You are terse.\n\n# Tools")
    assert json.dumps(TOOLS[0], ensure_ascii=False) in system
    assert "<tool_call>" in system
    assert json.loads(messages[2]["content"].removeprefix("<tool_call>\n").removesuffix(
        "\n</tool_call>")) == {"name": "get_weather",
                               "arguments": {"city": "Paris", "unit": "celsius"}}
    assert messages[3]["content"] == '<tool_response>\n{"temperature": 21}\n</tool_response>'
    none = ChatCompletionRequest.model_validate(
        {"messages": HISTORY, "tools": TOOLS, "tool_choice": "none"})
    assert "# Tools" not in conversation(none.messages, plan_tools(none), template)[0][0][
        "content"]


def _prompt_text(reply: dict[str, Any]) -> str:
    """The rendered prompt, read back from `prompt_logprobs: 0` (which holds each position's
    own token only), all but its first token."""
    return "".join(entry["decoded_token"] for position in reply["prompt_logprobs"][1:]
                   for entry in position.values())


def test_a_template_that_takes_tools_renders_them_itself(fast_model) -> None:
    """--chat-template replaces the model's; one that reads `tools` gets them (and past
    calls with their arguments as objects)."""
    template = ("{% for tool in tools %}[TOOL {{ tool.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for call in m.tool_calls or [] %}[CALL {{ call.function.arguments.city }}]"
                "{% endfor %}{% endfor %}<assistant>")
    config = ServerConfig(served_model_names=(MODEL,), chat_template=template)
    with serve(fast_model, config, num_gpu_blocks=64) as running, running.http() as http:
        reply = http.post(CHAT, json={"messages": HISTORY, "tools": TOOLS, "max_tokens": 1,
                                      "prompt_logprobs": 0}).json()
    prompt = _prompt_text(reply)
    assert "TOOL get_weather][TOOL get_time]<system>You are terse." in prompt
    assert "[CALL Paris]" in prompt
    assert prompt.endswith('<tool>{"temperature": 21}<assistant>')


# ------------------------------------------------------------------ over HTTP
def _validate_call(call: Any) -> dict[str, Any]:
    schema = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema[call.function.name])
    assert call.id.startswith("call_") and call.type == "function"
    return arguments


def test_required_returns_calls_whose_arguments_validate(server) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        max_completion_tokens=120, temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        _validate_call(call)


def test_a_named_function_is_called_with_valid_arguments(server) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_completion_tokens=60,
        temperature=0)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"  # OpenAI's answer for a named function
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    _validate_call(call)


def test_parallel_tool_calls_false_allows_one_call(server) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, max_completion_tokens=120, temperature=0)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_a_round_trip_call_result_answer(server) -> None:
    client = server.client()
    first = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, tool_choice=NAMED, max_completion_tokens=60,
        temperature=0)
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_celsius": 21}'},
    ]
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           max_completion_tokens=40, temperature=0)
    choice = final.choices[0]
    assert choice.message.content  # an answer in words
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert final.usage.prompt_tokens > first.usage.prompt_tokens  # the result is in the prompt


def _streamed_calls(chunks: list[Any]) -> tuple[str, list[tuple[str, str]], str | None]:
    """(content, [(name, arguments)], finish reason) reassembled from stream chunks."""
    content, names, arguments, reason = "", {}, {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reason = choice.finish_reason or reason
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    assert delta.type == "function" and delta.function.name
                    names[delta.index] = delta.function.name
                arguments[delta.index] = (arguments.get(delta.index, "")
                                          + (delta.function.arguments or ""))
    return content, [(names[i], arguments[i]) for i in sorted(names)], reason


def _whole_calls(reply: Any) -> tuple[str, list[tuple[str, str]], str | None]:
    message = reply.choices[0].message
    calls = [(call.function.name, call.function.arguments) for call in message.tool_calls or []]
    return message.content or "", calls, reply.choices[0].finish_reason


@pytest.mark.parametrize("tool_choice", ["required", "named"])
def test_streamed_tool_call_deltas_reassemble_to_the_whole_calls(server, tool_choice) -> None:
    options: dict[str, Any] = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "max_completion_tokens": 80,
        "temperature": 0, "tool_choice": NAMED if tool_choice == "named" else tool_choice}
    client = server.client()
    whole = _whole_calls(client.chat.completions.create(**options))
    streamed = _streamed_calls(list(client.chat.completions.create(stream=True, **options)))
    assert whole[1]
    assert streamed == whole


def test_auto_parses_hermes_calls_streamed_or_not(fast_server) -> None:
    """With tool_choice auto, the output (held here to a Hermes-style call by a regex, so a
    random-weight model writes one) is split into content and calls, streamed or not."""
    options: dict[str, Any] = {
        "model": MODEL, "messages": ASK, "tools": TOOLS, "max_completion_tokens": 60,
        "temperature": 0, "extra_body": {"structured_outputs": {"regex": HERMES_REGEX}}}
    client = fast_server.client()
    whole = client.chat.completions.create(**options)
    content, calls, reason = _whole_calls(whole)
    assert (content, reason) == ("Sure.", "tool_calls")
    ((name, arguments),) = calls
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    streamed = _streamed_calls(list(client.chat.completions.create(stream=True, **options)))
    assert streamed == (content, calls, reason)
    none = client.chat.completions.create(tool_choice="none", **options).choices[0]
    assert none.message.tool_calls is None
    assert none.message.content.startswith("Sure.<tool_call>")


BAD_PARAMETERS = {"type": "object", "properties": {"x": {"type": "nonsense"}}}
# (body beyond messages, the param the 400 names)
REFUSED = [
    ({"tools": []}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
    ({"tools": [TOOLS[0], {"type": "function", "function": {
        "name": "broken", "parameters": BAD_PARAMETERS}}], "tool_choice": "required"},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "broken",
                                                  "parameters": BAD_PARAMETERS}}],
      "tool_choice": {"type": "function", "function": {"name": "broken"}}},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": NAMED, "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
]


@pytest.mark.parametrize(("body", "param"), REFUSED)
def test_bad_tools_are_400_naming_the_field(fast_server, body, param) -> None:
    with fast_server.http() as http:
        response = http.post(CHAT, json={"messages": ASK, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text[:300]
    assert response.json()["error"]["param"] == param


def test_messages_with_tool_calls_and_null_content_are_accepted(fast_server) -> None:
    with fast_server.http() as http:
        response = http.post(CHAT, json={"messages": HISTORY, "max_tokens": 2})
    assert response.status_code == 200, response.text[:300]


def test_the_serve_flags_set_parser_and_template(tmp_path: Path) -> None:
    template = tmp_path / "template.jinja"
    template.write_text("{{ messages[0].content }}")
    args = build_parser().parse_args([
        "serve", "--tool-call-parser", "hermes", "--enable-auto-tool-choice",
        "--chat-template", str(template)])
    config = server_config_from_args(args)
    assert (config.tool_call_parser, config.chat_template) == ("hermes",
                                                               "{{ messages[0].content }}")
    inline = build_parser().parse_args(["serve", "--chat-template", "{{ 'x' }}"])
    assert server_config_from_args(inline).chat_template == "{{ 'x' }}"
    with pytest.raises(ValueError, match="no such file"):
        server_config_from_args(build_parser().parse_args(
            ["serve", "--chat-template", str(tmp_path / "missing.jinja")]))


def test_prompt_logprobs_read_back_is_a_real_http_body(fast_server) -> None:
    """The helper above reads vLLM's prompt_logprobs shape: keys are token ids (as JSON
    strings), values {logprob, rank, decoded_token}; the first position is null."""
    with fast_server.http() as http:
        reply = http.post(CHAT, json={"messages": ASK, "max_tokens": 1,
                                      "prompt_logprobs": 0}).json()
    assert reply["prompt_logprobs"][0] is None
    assert all(len(position) == 1 and set(next(iter(position.values()))) ==
               {"logprob", "rank", "decoded_token"} for position in reply["prompt_logprobs"][1:])

"""Structured outputs over HTTP: OpenAI's `response_format` (and the client's `parse()` helper)
and vLLM's `structured_outputs` (json, regex, choice, grammar, json_object), on the real
SmolLM2 where the output must hold; on the fast model, constraints the grammar compiler
refuses are a 400 naming the field the client wrote them in, before the engine sees them."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server.conftest import MODEL, RunningServer

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
GREEDY: dict[str, Any] = {"temperature": 0}
USER = [{"role": "user", "content": "Give me a city and its country as JSON."}]
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


class CityInfo(BaseModel):
    city: str
    country: str


def test_parse_returns_the_pydantic_object(server) -> None:
    """The official client's `parse()` sends `response_format: json_schema` (strict) and
    validates the reply into the model: it only works if the output matches the schema and
    finishes on its own (a "length" finish makes the client raise)."""
    completion = server.client().chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Which city is the capital of "
                                                          "France? Answer in JSON."}],
        response_format=CityInfo, max_completion_tokens=120, **GREEDY,
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, CityInfo)
    assert completion.choices[0].finish_reason == "stop"
    assert CityInfo.model_validate_json(message.content) == message.parsed


def test_json_object_returns_valid_json(server) -> None:
    reply = server.client().chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "json_object"},
        max_completion_tokens=80, **GREEDY,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    json.loads(choice.message.content)


def test_json_schema_holds_on_completions_streamed_or_not(server) -> None:
    """vLLM also takes response_format on /v1/completions; a stream yields the same text."""
    client = server.client()
    options: dict[str, Any] = {
        "model": MODEL, "prompt": "A person, as JSON:", "max_tokens": 60, **GREEDY,
        "extra_body": {"response_format": {"type": "json_schema", "json_schema": {
            "name": "person", "schema": PERSON_SCHEMA}}},
    }
    whole = client.completions.create(**options).choices[0]
    assert whole.finish_reason == "stop"
    jsonschema.validate(json.loads(whole.text), PERSON_SCHEMA)
    streamed = "".join(chunk.choices[0].text
                       for chunk in client.completions.create(stream=True, **options))
    assert streamed == whole.text


def test_structured_outputs_regex_choice_and_grammar(server) -> None:
    client = server.client()
    phone = client.completions.create(
        model=MODEL, prompt="Call me at", max_tokens=12, **GREEDY,
        extra_body={"structured_outputs": {"regex": r" [0-9]{3}-[0-9]{4}"}},
    ).choices[0]
    assert re.fullmatch(r" [0-9]{3}-[0-9]{4}", phone.text), phone.text
    assert phone.finish_reason == "stop"
    choices = ["Paris", "London", "Berlin"]
    capital = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "The capital of Germany?"}],
        max_completion_tokens=8, **GREEDY, extra_body={"structured_outputs": {"choice": choices}},
    ).choices[0]
    assert capital.message.content in choices
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is water wet?"}],
        max_completion_tokens=8, **GREEDY,
        extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
    ).choices[0]
    assert answer.message.content in ("yes", "no")


def _post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.http() as http:
        return http.post(path, json=body)


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}
# (path, body, the param the 400 names)
REFUSED = [
    (CHAT, {"messages": USER, "response_format": SCHEMA_FORMAT},
     "response_format.json_schema.schema"),
    (COMPLETIONS, {"prompt": "hi", "response_format": SCHEMA_FORMAT},
     "response_format.json_schema.schema"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"json": {"type": "nonsense"}}},
     "structured_outputs.json"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "[a-"}},
     "structured_outputs.regex"),
    (CHAT, {"messages": USER, "structured_outputs": {"grammar": "root ::= "}},
     "structured_outputs.grammar"),
    (CHAT, {"messages": USER, "structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"json": "{not json"}},
     "structured_outputs.json"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {}}, "structured_outputs"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"},
            "structured_outputs": {"regex": "a"}}, "response_format"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"messages": USER, "response_format": {"type": "structural_tag"}},
     "response_format.type"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"regex": "a",
                                                          "disable_any_whitespace": True}},
     "structured_outputs.disable_any_whitespace"),
    (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"structural_tag": "{}"}},
     "structured_outputs.structural_tag"),
    (COMPLETIONS, {"prompt": "hi", "guided_json": {"type": "object"}}, "guided_json"),
    (CHAT, {"messages": USER, "guided_regex": "a+"}, "guided_regex"),
]


@pytest.mark.parametrize(("path", "body", "param"), REFUSED)
def test_a_refused_constraint_is_400_naming_its_field_before_the_engine(
    fast_server, path, body, param
) -> None:
    before = fast_server.engine.snapshot().stats.num_prompt_tokens
    response = _post(fast_server, path, {"max_tokens": 4, **body})
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert fast_server.engine.snapshot().stats.num_prompt_tokens == before  # never queued


def test_the_openai_client_raises_bad_request_for_an_invalid_regex(fast_server) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        fast_server.client().completions.create(
            model=MODEL, prompt="hi", max_tokens=2,
            extra_body={"structured_outputs": {"regex": "("}})
    assert refused.value.body["param"] == "structured_outputs.regex"


def test_response_format_text_constrains_nothing(fast_server) -> None:
    reply = fast_server.client().chat.completions.create(
        model=MODEL, messages=USER, response_format={"type": "text"}, max_completion_tokens=3,
        temperature=0, extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length"

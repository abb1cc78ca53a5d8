"""Work before limits, over real HTTP: text too long to fit the model is refused before the
tokenizer runs, and grammars too large or too slow to compile are refused within their bounds
(issue 28, point 7)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, RunningServer

MAX_MODEL_LEN = 2048
MAX_CHARS = 81 * (MAX_MODEL_LEN + 1)  # SmolLM2's longest token, in characters, × (len + 1)
HUGE = "lorem " * (3_500_000 // 6)  # 3.5 MB: 8 s of tokenizing before the fix


@pytest.fixture
def encode_calls(fast_model, monkeypatch) -> Iterator[list[int]]:
    """The length of every text the server's tokenizer encodes."""
    tokenizer = fast_model.tokenizer
    encode, calls = tokenizer.encode, []

    def counting(text: str, *args: Any, **kwargs: Any) -> list[int]:
        calls.append(len(text))
        return encode(text, *args, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", counting)
    yield calls


@pytest.fixture
def server(make_server) -> RunningServer:
    return make_server(ServerConfig(served_model_names=(MODEL,)), max_model_len=MAX_MODEL_LEN)


def post(server: RunningServer, path: str, body: dict[str, Any]) -> httpx.Response:
    with server.http() as http:
        return http.post(path, json=body)


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/completions", {"model": MODEL, "prompt": HUGE, "max_tokens": 1}, "prompt"),
    ("/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": HUGE}]}, "messages"),
    ("/tokenize", {"model": MODEL, "prompt": HUGE}, "prompt"),
    ("/v1/kv/explain", {"prompt": HUGE}, "prompt"),
])
def test_a_35_mb_prompt_gets_400_without_being_tokenized(
    server: RunningServer, encode_calls: list[int], path: str, body: dict[str, Any], param: str,
) -> None:
    response = post(server, path, body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param
    assert f"more than the {MAX_CHARS} any prompt that fits" in error["message"]
    assert f"({MAX_MODEL_LEN} tokens)" in error["message"]
    assert encode_calls == []


def test_text_under_the_bound_is_tokenized_and_checked_in_tokens(
    server: RunningServer, encode_calls: list[int],
) -> None:
    response = post(server, "/v1/completions",
                    {"model": MODEL, "prompt": "word " * 3000, "max_tokens": 1})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert "the prompt has 3001 tokens, but max_model_len is 2048" in error["message"]
    assert encode_calls == [15000]
    ok = post(server, "/v1/completions", {"model": MODEL, "prompt": "word " * 10, "max_tokens": 1})
    assert ok.status_code == 200


@pytest.fixture
def grammar_server(make_server) -> RunningServer:
    # 0.05 s: well under `.{0,1000}`'s compile (over a second here, with xgrammar's set-up).
    config = ServerConfig(served_model_names=(MODEL,), max_grammar_chars=1000,
                          grammar_compile_timeout=0.05, input_workers=2)
    return make_server(config)


def test_a_regex_that_compiles_for_seconds_gets_400_at_the_timeout(
    grammar_server: RunningServer,
) -> None:
    """`.{0,1000}` compiles for seconds here (`.{0,100000}`, issue 28's, for longer)."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2,
            "structured_outputs": {"regex": ".{0,1000}"}}
    response = post(grammar_server, "/v1/completions", body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.regex"
    assert error["message"].startswith("the regex did not compile within 0.05 s")


def test_a_schema_over_max_grammar_chars_gets_400(make_server) -> None:
    # A timeout no compile reaches here: only the size is under test.
    config = ServerConfig(served_model_names=(MODEL,), max_grammar_chars=1000,
                          grammar_compile_timeout=120)
    grammar_server = make_server(config)
    properties = {f"field_{i}": {"type": "string"} for i in range(60)}
    schema = {"type": "object", "properties": properties}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "s", "schema": schema}}}
    response = post(grammar_server, "/v1/chat/completions", body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert error["message"].endswith("characters; at most 1000 are accepted")
    small = {**body, "response_format": {"type": "json_object"}}
    ok = post(grammar_server, "/v1/chat/completions", small)
    assert ok.status_code == 200, ok.text

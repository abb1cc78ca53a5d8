"""Bad input gets a clear 4xx in OpenAI's error shape (never FastAPI's 422, never a 5xx) and
the message never echoes an unbounded value back."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from kvpool.server.config import ServerConfig
from kvpool.server.errors import MAX_MESSAGE_CHARS
from tests.server.conftest import MODEL, RunningServer, serve

MAX_MODEL_LEN = 64
MAX_REQUEST_BYTES = 64 * 1024
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(fast_model) -> Iterator[RunningServer]:
    config = ServerConfig(served_model_names=(MODEL,), max_request_bytes=MAX_REQUEST_BYTES)
    with serve(fast_model, config, num_gpu_blocks=64, max_model_len=MAX_MODEL_LEN) as running:
        yield running


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    """The OpenAI error object of a response that must have `status`."""
    assert response.status_code == status, response.text[:500]
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert len(body["error"]["message"]) <= MAX_MESSAGE_CHARS
    return body["error"]


def post(server: RunningServer, path: str, body: Any) -> httpx.Response:
    content = json.dumps(body)  # ASCII escapes, so lone surrogates travel as JSON allows
    with server.http() as http:
        return http.post(path, content=content, headers={"content-type": "application/json"})


# (path, body, param the error names, words the message contains)
BAD_BODIES = [
    (COMPLETIONS, {"model": MODEL}, "prompt", "Field required"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": "5"}, "max_tokens", "valid integer"),
    (COMPLETIONS, {"prompt": "hi", "n": True}, "n", "valid integer"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature", "valid number"),
    (COMPLETIONS, {"prompt": 5}, "prompt", "valid"),
    (COMPLETIONS, {"prompt": "hi", "stop": 3}, "stop", "valid"),
    (COMPLETIONS, {"prompt": "hi", "stream": "yes"}, "stream", "valid boolean"),
    (CHAT, {"messages": "hi"}, "messages", "valid list"),
    (CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages", "Input should be"),
    (COMPLETIONS, {"prompt": ""}, "prompt", "must not be empty"),
    (COMPLETIONS, {"prompt": []}, "prompt", "must not be empty"),
    (COMPLETIONS, {"prompt": [[1, 2], []]}, "prompt", "must not be empty"),
    (CHAT, {"messages": []}, "messages", "must not be empty"),
    (COMPLETIONS, {"prompt": [49152]}, "prompt", "token ids must be in"),
    (COMPLETIONS, {"prompt": list(range(1, MAX_MODEL_LEN + 1))}, "prompt", "context length"),
    (COMPLETIONS, {"prompt": "word " * 200}, "prompt", "context length"),
    (CHAT, {"messages": [{"role": "user", "content": "word " * 200}]}, "messages", "context"),
    (COMPLETIONS, {"prompt": [1] * 10, "max_tokens": 60}, "max_tokens", "leaves 54"),
    (CHAT, {"messages": USER, "max_completion_tokens": 999}, "max_completion_tokens", "context"),
    (COMPLETIONS, {"prompt": "hi", "n": 17}, "n", "at most 16"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, "n", "n must be at least 1"),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, "temperature", "must be >= 0"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p", "(0, 1]"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1.5}, "top_p", "(0, 1]"),
    (COMPLETIONS, {"prompt": "hi", "min_p": 2}, "min_p", "[0, 1]"),
    (COMPLETIONS, {"prompt": "hi", "top_k": -5}, "top_k", "top_k"),
    (COMPLETIONS, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty", "[-2, 2]"),
    (COMPLETIONS, {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}, "max_tokens", "less than or equal"),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens", "exceed"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs", "[0, 20]"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, "echo", "not supported"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["a"] * 17}, "stop", "at most 16"),
    (COMPLETIONS, {"prompt": "hi", "stop": [""]}, "stop", "non-empty"),
    (COMPLETIONS, {"prompt": "hi", "cache_salt": "s" * 300}, "cache_salt", "at most 256"),
    (COMPLETIONS, {"prompt": "hi\ud800"}, "prompt", "could not be tokenized"),
]


@pytest.mark.parametrize(("path", "body", "param", "words"), BAD_BODIES)
def test_bad_request_is_400_naming_the_parameter(server, path, body, param, words) -> None:
    error = error_of(post(server, path, body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert words in error["message"]


@pytest.mark.parametrize(
    ("raw", "content_type", "words"),
    [
        (b'{"prompt": "hi"', "application/json", "not valid JSON"),
        (b"\xff\xfe{}", "application/json", "not valid JSON"),
        (b"[1, 2]", "application/json", "JSON object"),
        (b'{"prompt": "hi", "temperature": NaN}', "application/json", "finite number"),
        (b'{"prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", "application/json", "parsed"),
        (b'{"prompt": "hi"}', "text/plain", "JSON object"),
    ],
)
def test_malformed_body_is_400(server, raw: bytes, content_type: str, words: str) -> None:
    with server.http() as http:
        response = http.post(COMPLETIONS, content=raw, headers={"content-type": content_type})
    assert words in error_of(response, 400)["message"]


def test_unknown_model_is_404_as_openai_answers_without_echoing_it(server) -> None:
    long_name = "m" * 50_000
    error = error_of(post(server, COMPLETIONS, {"model": long_name, "prompt": "hi"}), 404)
    assert error["code"] == "model_not_found"
    assert long_name[:1000] not in error["message"]
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="other-model", prompt="hi", max_tokens=1)


def test_oversized_body_is_413_declared_or_chunked(server) -> None:
    body = json.dumps({"prompt": "x" * MAX_REQUEST_BYTES}).encode()
    headers = {"content-type": "application/json"}
    with server.http() as http:
        declared = http.post(COMPLETIONS, content=body, headers=headers)
        chunked = http.post(COMPLETIONS, content=iter([body[:1000], body[1000:]]), headers=headers)
    for response in (declared, chunked):
        assert error_of(response, 413)["code"] == "request_too_large"


def test_wrong_route_and_method_keep_the_error_shape(server) -> None:
    with server.http() as http:
        assert error_of(http.get("/v1/nothing"), 404)["message"] == "no such route"
        error_of(http.get(COMPLETIONS), 405)


def test_openai_client_raises_bad_request(server) -> None:
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1000)
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=USER, top_p=7.0)


def test_no_work_was_done_for_any_rejected_request(server) -> None:
    """Everything above was refused before reaching the engine (or, for the token id out of
    the vocabulary, by its validation): no prompt token was ever counted."""
    snapshot = server.engine.snapshot()
    assert snapshot.stats.num_prompt_tokens == 0
    assert snapshot.memory.num_allocations == 0


def test_beyond_max_concurrent_requests_is_429(make_server) -> None:
    server = make_server(ServerConfig(served_model_names=(MODEL,), max_concurrent_requests=1))
    client = server.client()
    stream = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}
    )
    next(iter(stream))  # the request is in flight
    with pytest.raises(openai.RateLimitError, match="more than 1 concurrent"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    stream.close()
    deadline = time.monotonic() + 10
    while True:  # the slot comes back once the server has seen the disconnect
        try:
            completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the closed stream never released its slot"
            time.sleep(0.05)
    assert completion.choices[0].finish_reason == "length"

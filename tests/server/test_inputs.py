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

from kvpool.openai.errors import MAX_MESSAGE_CHARS
from kvpool.server.config import ServerConfig
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
    assert body["error"]["code"] == status  # vLLM's shape: the HTTP status, an integer
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
    (COMPLETIONS, {"prompt": [1] * 10, "max_tokens": 65}, "max_tokens", "context length, 64"),
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
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty", "[0.01, 100]"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens", "at least 1"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**30}, "max_tokens", "less than or equal"),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": 9, "max_tokens": 4}, "min_tokens", "exceed"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens", "at least 1"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 21}, "logprobs", "[0, 20]"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs", "needs logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
    (CHAT, {"messages": USER, "echo": True}, "echo", "not supported"),
    (COMPLETIONS, {"prompt": "hi", "use_beam_search": True, "temperature": 0.7}, "temperature",
     "use_beam_search"),
    (COMPLETIONS, {"prompt": "hi", "use_beam_search": True, "stop": ["x"]}, "stop",
     "use_beam_search"),
    (COMPLETIONS, {"prompt": "hi", "use_beam_search": True, "n": 3, "best_of": 2}, "best_of",
     "at least n"),
    (COMPLETIONS, {"prompt": "hi", "best_of": 3}, "best_of", "unless use_beam_search"),
    (COMPLETIONS, {"prompt": "hi", "length_penalty": 0.5}, "length_penalty",
     "needs use_beam_search"),
    (CHAT, {"messages": USER, "use_beam_search": True}, "use_beam_search", "completions only"),
    (COMPLETIONS, {"prompt": "hi", "truncate_prompt_tokens": 4}, "truncate_prompt_tokens",
     "not supported"),
    (COMPLETIONS, {"prompt": "hi", "return_token_ids": True}, "return_token_ids",
     "not supported"),
    (COMPLETIONS, {"prompt": "hi", "spaces_between_special_tokens": False},
     "spaces_between_special_tokens", "only"),
    (CHAT, {"messages": USER, "functions": [{"name": "f"}]}, "functions", "use tools"),
    (CHAT, {"messages": USER, "audio": {"voice": "x"}}, "audio", "not supported"),
    (CHAT, {"messages": USER, "chat_template": "{{ x }}"}, "chat_template", "--chat-template"),
    (CHAT, {"messages": USER, "continue_final_message": True}, "continue_final_message",
     "add_generation_prompt"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"x1": 5}}, "logit_bias", "token ids"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"49152": 1}}, "logit_bias", "must be in"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"5": "up"}}, "logit_bias", "valid number"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids", "greater than"),
    (COMPLETIONS, {"prompt": "hi", "stop_token_ids": [49152]}, "stop_token_ids", "must be in"),
    (COMPLETIONS, {"prompt": "hi", "allowed_token_ids": []}, "allowed_token_ids", "non-empty"),
    (COMPLETIONS, {"prompt": "hi", "bad_words": [""]}, "bad_words", "non-empty"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs", "[0, 20]"),
    (COMPLETIONS, {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs",
     "stream"),
    (CHAT, {"messages": USER, "prompt_logprobs": -1}, "prompt_logprobs", "[0, 20]"),
    (COMPLETIONS, {"prompt": "hi", "priority": "high"}, "priority", "valid integer"),
    (COMPLETIONS, {"prompt": "hi", "skip_special_tokens": "no"}, "skip_special_tokens",
     "valid boolean"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "x"}, "suffix", "not supported"),
    (COMPLETIONS, {"prompt": "hi", "stop": ["a"] * 17}, "stop", "at most 16"),
    (COMPLETIONS, {"prompt": "hi", "stop": [""]}, "stop", "non-empty"),
    (COMPLETIONS, {"prompt": "hi", "cache_salt": "s" * 300}, "cache_salt", "at most 256"),
    (CHAT, {"messages": USER, "cache_salt": "x\udfff"}, "cache_salt", "valid Unicode"),
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
    assert (error["code"], error["param"]) == (404, "model")
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
        assert error_of(response, 413)["type"] == "invalid_request_error"


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


def test_a_lone_surrogate_cache_salt_is_400_naming_cache_salt_before_the_engine(
    server, monkeypatch
) -> None:
    """Regression: the engine's hashing raised UnicodeEncodeError (a ValueError), which the
    server read as a prompt error. The raw JSON escape reaches the server as a lone surrogate."""
    added = []

    async def add_request(*args: Any, **kwargs: Any) -> Any:
        added.append(args)
        raise AssertionError("the request reached the engine")

    monkeypatch.setattr(server.engine, "add_request", add_request)
    raw = b'{"prompt": "hi", "max_tokens": 1, "cache_salt": "\\ud800"}'
    with server.http() as http:
        response = http.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    error = error_of(response, 400)
    assert (error["param"], error["code"]) == ("cache_salt", 400)
    assert "\ud800" not in error["message"]
    assert added == []


GARBAGE = "zq" + "x7" * 3000 + "qz"  # long, and in no message by chance
# (path, body, param, the client's value as it could appear in a message)
ECHO_BAIT = [
    (COMPLETIONS, {"prompt": "hi", "model": GARBAGE}, "model", GARBAGE[:65]),
    (COMPLETIONS, {"prompt": "hi", "model": "\ud800" + GARBAGE}, "model", GARBAGE[:64]),
    (COMPLETIONS, {"prompt": "hi", "stop": [GARBAGE]}, "stop", GARBAGE[:20]),
    (COMPLETIONS, {"prompt": "hi", "cache_salt": GARBAGE}, "cache_salt", GARBAGE[:20]),
    (COMPLETIONS, {"prompt": "hi", "cache_salt": GARBAGE[:9] + "\ud800"}, "cache_salt",
     GARBAGE[:9]),
    (COMPLETIONS, {"prompt": "hi", "temperature": GARBAGE}, "temperature", GARBAGE[:20]),
    (COMPLETIONS, {"prompt": "hi", "seed": GARBAGE}, "seed", GARBAGE[:20]),
    (COMPLETIONS, {"prompt": GARBAGE}, "prompt", GARBAGE[:20]),  # 6,000 characters: too long
    (COMPLETIONS, {"prompt": "hi", "suffix": GARBAGE}, "suffix", GARBAGE[:20]),
    (CHAT, {"messages": [{"role": GARBAGE, "content": "hi"}]}, "messages", GARBAGE[:20]),
    (CHAT, {"messages": [{"role": "user", "content": 7}], "user": GARBAGE}, "messages",
     GARBAGE[:20]),
    (COMPLETIONS, {"prompt": "hi", "temperature": -1.2345}, "temperature", "1.2345"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 1.2345}, "top_p", "1.2345"),
    (COMPLETIONS, {"prompt": "hi", "min_p": -0.98765}, "min_p", "98765"),
    (COMPLETIONS, {"prompt": "hi", "repetition_penalty": 123.456}, "repetition_penalty", "456"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 987654321}, "max_tokens", "987654321"),
    (CHAT, {"messages": USER, "max_completion_tokens": 987654321}, "max_completion_tokens",
     "987654321"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**40}, "max_tokens", "0" * 40),
    (COMPLETIONS, {"prompt": "hi", "n": 987654}, "n", "987654"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": 987654}, "logprobs", "987654"),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": 45678, "max_tokens": 4}, "min_tokens",
     "45678"),
]


@pytest.mark.parametrize(("path", "body", "param", "value"), ECHO_BAIT)
def test_error_messages_never_include_the_offending_value(
    server, path, body, param, value
) -> None:
    status = 404 if param == "model" else 400
    error = error_of(post(server, path, body), status)
    assert error["param"] == param
    assert value not in error["message"]
    assert value not in (error["param"] or "")


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


def test_beyond_max_queued_sequences_is_429_and_never_reaches_the_engine(make_server) -> None:
    """prompts × n, summed over the requests in flight: 3 + 2 > 4 is refused, 3 + 1 fits; a
    request that alone asks for more than the limit can never fit, so it gets 400, not 429."""
    server = make_server(ServerConfig(served_model_names=(MODEL,), max_queued_sequences=4))
    client = server.client()
    stream = client.completions.create(
        model=MODEL, prompt="hello", max_tokens=2000, n=3, temperature=1.0, stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # three sequences are in flight
    num_prompt_tokens = server.engine.snapshot().stats.num_prompt_tokens
    with server.http() as http:
        refused = [
            http.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, "n": 2}),
            http.post(COMPLETIONS, json={"prompt": ["hi", "there"], "max_tokens": 1}),
            http.post(CHAT, json={"messages": USER, "max_tokens": 1, "n": 2}),
        ]
        alone = http.post(COMPLETIONS, json={"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 2})
    for response in refused:
        assert error_of(response, 429)["type"] == "rate_limit_error"
        assert response.headers["retry-after"] == "1"
        assert "more than 4 sequences" in response.json()["error"]["message"]
    assert error_of(alone, 400)["param"] == "n"
    assert server.engine.snapshot().stats.num_prompt_tokens == num_prompt_tokens  # none added
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=1, n=2)
    fits = client.completions.create(model=MODEL, prompt="hi", max_tokens=1)
    assert fits.choices[0].finish_reason == "length"
    stream.close()
    deadline = time.monotonic() + 10
    while True:  # the room comes back once the server has seen the disconnect
        try:
            completion = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=1,
                                                   n=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline, "the closed stream never released its sequences"
            time.sleep(0.05)
    assert len(completion.choices) == 4


def test_max_tokens_beyond_the_room_is_clamped_as_vllm_does(make_server) -> None:
    """Only a budget beyond the whole context is an error; within it, the output gets what
    the context leaves after the prompt."""
    server = make_server(max_model_len=MAX_MODEL_LEN)
    completion = server.client().completions.create(
        model=MODEL, prompt=[1] * 10, max_tokens=MAX_MODEL_LEN, extra_body={"ignore_eos": True})
    assert completion.usage.completion_tokens == MAX_MODEL_LEN - 10
    assert completion.choices[0].finish_reason == "length"
    reply = server.client().chat.completions.create(
        model=MODEL, messages=USER, max_completion_tokens=MAX_MODEL_LEN,
        extra_body={"ignore_eos": True})
    assert reply.usage.total_tokens == MAX_MODEL_LEN


def test_fields_left_out_take_the_models_generation_config_defaults(make_server) -> None:
    """`engine.default_sampling_params()` (the model's generation_config.json) fills what a
    request leaves out: here a greedy default and a chat output budget of 3 tokens."""
    server = make_server()
    server.engine.engine.default_sampling_params = lambda: {"temperature": 0.0, "max_tokens": 3}
    client = server.client()
    replies = [client.chat.completions.create(model=MODEL, messages=USER, seed=seed,
                                              extra_body={"ignore_eos": True})
               for seed in (1, 2)]
    assert [reply.usage.completion_tokens for reply in replies] == [3, 3]
    assert replies[0].choices[0].message.content == replies[1].choices[0].message.content
    explicit = client.chat.completions.create(model=MODEL, messages=USER, max_tokens=5,
                                              extra_body={"ignore_eos": True})
    assert explicit.usage.completion_tokens == 5


def test_neutral_values_of_unsupported_fields_and_vllm_nulls_pass(make_server) -> None:
    """Clients often send defaults explicitly: those are accepted, as are seed -1 and stop
    null (vLLM's "none"), n and logprobs null, and fields no one defines."""
    server = make_server()
    with server.http() as http:
        completion = http.post(COMPLETIONS, json={
            "prompt": "hi", "max_tokens": 2, "use_beam_search": False, "best_of": 1,
            "length_penalty": 1.0, "spaces_between_special_tokens": True, "seed": -1,
            "stop": None, "n": None, "echo": False, "suffix": None, "made_up_field": [1],
            "guided_json": None, "priority": -3, "store": True, "metadata": {"a": "b"}})
        chat = http.post(CHAT, json={
            "messages": USER, "max_tokens": 2, "logprobs": None, "tool_choice": "none",
            "response_format": {"type": "text"}, "parallel_tool_calls": True,
            "modalities": ["text"], "service_tier": "auto", "reasoning_effort": "low"})
    assert completion.status_code == chat.status_code == 200, (completion.text, chat.text)

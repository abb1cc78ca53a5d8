"""Over real HTTP: a temperature above 2 (OpenAI's and vLLM's bound) and token rules past
their caps (logit_bias 300 keys, allowed_token_ids 8192, bad_words 128 words and 1024 tokens)
are a 400 naming the field; at the caps a request runs."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.server.conftest import MODEL

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


def post(server, path: str, **fields: Any) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, **fields}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    with server.http() as http:
        return http.post(path, json=body)


def assert_refused(response: httpx.Response, param: str, words: str) -> None:
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


@pytest.mark.parametrize("path", [COMPLETIONS, CHAT])
@pytest.mark.parametrize("temperature", [1e308, 2.5])
def test_a_temperature_above_two_is_a_400(fast_server, path, temperature):
    assert_refused(post(fast_server, path, temperature=temperature), "temperature",
                   "temperature must be in [0, 2]")


@pytest.mark.parametrize(("field", "value", "words"), [
    ("logit_bias", {str(token_id): 1 for token_id in range(301)}, "at most 300 entries"),
    ("allowed_token_ids", list(range(8193)), "at most 8192 entries"),
    ("bad_words", [f"w{index}" for index in range(129)], "at most 128 entries"),
    ("bad_words", [f"{index} " + "the quick brown fox jumps over the lazy dog " * 16
                   for index in range(4)], "at most 1024 tokens"),
])
def test_token_rules_past_their_caps_are_a_400(fast_server, field, value, words):
    assert_refused(post(fast_server, COMPLETIONS, **{field: value}), field, words)


def test_requests_at_the_caps_run(fast_server):
    at_caps = {"temperature": 2.0, "logit_bias": {str(token_id): 1 for token_id in range(300)},
               "allowed_token_ids": list(range(8192)),
               "bad_words": [f"w{index}" for index in range(128)]}
    for path in (COMPLETIONS, CHAT):
        response = post(fast_server, path, **at_caps)
        assert response.status_code == 200, response.text[:300]
    fast_server.wait_until_idle()

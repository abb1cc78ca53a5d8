"""The hop bodies of disaggregated routing as pure functions: what the prefill worker is sent,
what is read back from its answer (null, missing, an object; anything else refused), and what
the decode worker is sent."""

from __future__ import annotations

import json

import pytest

from kvpool.router.disagg import (
    REMOTE_DECODE,
    decode_body,
    kv_transfer_params,
    parse_request,
    prefill_body,
)


def test_the_prefill_body_asks_for_one_token_and_a_remote_decode() -> None:
    request = {"prompt": [1, 2, 3], "max_tokens": 30, "stream": True, "temperature": 0.7,
               "stream_options": {"include_usage": True}, "kv_transfer_params": {"x": 1}}
    assert json.loads(prefill_body(request)) == {
        "prompt": [1, 2, 3], "max_tokens": 1, "stream": False, "temperature": 0.7,
        "kv_transfer_params": REMOTE_DECODE}
    assert "n" not in json.loads(prefill_body({"prompt": "a"}))  # only set where given
    assert request["max_tokens"] == 30  # the client's request is left as it was


def test_the_prefill_body_drops_what_shapes_only_the_output() -> None:
    request = {"prompt": "a", "min_tokens": 8, "logprobs": 3, "echo": True,
               "prompt_logprobs": 1, "use_beam_search": True, "best_of": 4,
               "length_penalty": 0.5, "seed": 7}
    assert json.loads(prefill_body(request)) == {
        "prompt": "a", "seed": 7, "max_tokens": 1, "stream": False,
        "kv_transfer_params": REMOTE_DECODE}


@pytest.mark.parametrize("answer, params", [
    (b'{"choices": [], "kv_transfer_params": null}', None),
    (b'{"choices": []}', None),
    (b'{"kv_transfer_params": {"remote_block_ids": [1, 2], "extra": {"a": []}}}',
     {"remote_block_ids": [1, 2], "extra": {"a": []}}),
])
def test_the_prefill_answer_gives_its_params(answer, params) -> None:
    assert kv_transfer_params(answer) == params


@pytest.mark.parametrize("answer", [b"not json", b"[1]", b'{"kv_transfer_params": [1]}'])
def test_an_answer_off_the_contract_is_refused(answer) -> None:
    with pytest.raises(ValueError):
        kv_transfer_params(answer)


def test_the_decode_body_is_the_clients_with_the_params_or_unchanged() -> None:
    body = b'{"prompt": "a",  "stream": true, "kv_transfer_params": null}'
    request = parse_request(body)
    assert decode_body(body, request, None) is body
    assert json.loads(decode_body(body, request, {"remote_engine_id": "e"})) == {
        "prompt": "a", "stream": True, "kv_transfer_params": {"remote_engine_id": "e"}}


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b"\xff\xfe", b'"text"'])
def test_a_body_that_is_not_a_json_object_is_not_split(body) -> None:
    assert parse_request(body) is None

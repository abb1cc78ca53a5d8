"""kv_transfer_params over HTTP, as vLLM's disaggregation proxy sends them, between two real
servers in this process (`LoopbackConnector`; tests/server/test_disaggregated_serving.py runs
separate processes over Mooncake): the prefill worker's response carries the handover, the
decode worker given it answers as a plain server does, streamed or not, chat or completions;
a failed load under policy "fail" is a 502 naming the failure; requests a server cannot honour
are 400s naming the field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import MODEL, serve

PROMPT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
          "steps as his father had taught him, and lit the great lamp. ") * 3
PREFILL = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
           "remote_block_ids": None, "remote_host": None, "remote_port": None}


def transfer(role: str, **options) -> dict:
    return {"kv_transfer_config": {"kv_connector": "LoopbackConnector", "kv_role": role,
                                   **options}}


@pytest.fixture(scope="module")
def servers(fast_model) -> Iterator[dict]:
    with (serve(fast_model, **transfer("kv_producer")) as producer,
          serve(fast_model, **transfer("kv_consumer")) as consumer,
          serve(fast_model, **transfer("kv_consumer", kv_load_failure_policy="fail")) as failing,
          serve(fast_model) as plain):
        yield {"producer": producer, "consumer": consumer, "failing": failing, "plain": plain}
        for server in (producer, consumer, failing):
            assert server.wait_until_idle()["num_used_blocks"] == 0  # leases released


def handover(producer, route: str = "completions") -> dict:
    client = producer.client()
    if route == "completions":
        response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1,
                                             temperature=0,
                                             extra_body={"kv_transfer_params": PREFILL})
    else:
        response = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=1,
            temperature=0, extra_body={"kv_transfer_params": PREFILL})
    params = response.model_extra["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_block_ids"]
    return params


def test_a_decode_worker_answers_as_a_plain_server(servers) -> None:
    params = handover(servers["producer"])
    decoded = servers["consumer"].client().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
        extra_body={"kv_transfer_params": params})
    plain = servers["plain"].client().completions.create(model=MODEL, prompt=PROMPT,
                                                         max_tokens=16, temperature=0)
    assert decoded.choices[0].text == plain.choices[0].text
    assert decoded.usage.prompt_tokens_details.cached_tokens == len(
        params["remote_block_ids"]) * 16
    assert decoded.model_extra["kv_transfer_params"] is None


def test_chat_streams_the_same_answer(servers) -> None:
    params = handover(servers["producer"], "chat")
    messages = [{"role": "user", "content": PROMPT}]
    stream = servers["consumer"].client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True,
        extra_body={"kv_transfer_params": params})
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices)
    plain = servers["plain"].client().chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert streamed == plain.choices[0].message.content


def test_a_failed_load_under_policy_fail_is_a_502(servers) -> None:
    params = {**handover(servers["producer"]), "remote_engine_id": "gone"}
    with pytest.raises(openai.APIStatusError) as caught:
        servers["failing"].client().completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=4, extra_body={"kv_transfer_params": params})
    assert caught.value.status_code == 502
    assert "prefill worker failed" in caught.value.message and "gone" in caught.value.message
    # The lease is the producer's until it expires; end it as its reader would have.
    with servers["producer"].http() as http:
        assert http.get("/health").status_code == 200
    servers["producer"].engine.engine.kv_connector.producer.release_later(
        params["remote_lease_id"])


@pytest.mark.parametrize(("server", "body", "message"), [
    ("plain", {"prompt": PROMPT, "kv_transfer_params": PREFILL}, "kv-transfer-config"),
    ("consumer", {"prompt": PROMPT, "kv_transfer_params": PREFILL}, "kv_consumer"),
    ("producer", {"prompt": [PROMPT, PROMPT], "kv_transfer_params": PREFILL}, "one prompt"),
    ("consumer", {"prompt": PROMPT, "kv_transfer_params": {"do_remote_prefill": True}},
     "remote_engine_id"),
])
def test_what_a_server_cannot_honour_is_a_400(servers, server, body, message) -> None:
    response = httpx.post(f"{servers[server].base_url}/v1/completions", timeout=60,
                          json={"model": MODEL, "max_tokens": 2, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["param"] == "kv_transfer_params"
    assert json.dumps(PROMPT[:40]) not in error["message"]

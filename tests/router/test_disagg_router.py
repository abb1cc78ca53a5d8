"""Disaggregated routing (`--prefill` / `--decode`) against scripted workers on real loopback
ports (`tests/router/fake_worker.py`): the prefill worker gets the client's body cut to one
token, not streamed, asking for a remote decode; the decode worker gets the client's body as it
came plus exactly the prefill's kv_transfer_params (or, after null, the body byte for byte), and
its answer, whole or streamed chunk by chunk, is the client's. A prefill's 4xx is the client's
answer and no decode is called; a prefill that is down or answers 5xx is retried once on
another, else 502; a client that leaves during the prefill cancels it; a repeated prompt goes
to the prefill worker that reported its blocks."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from kvpool.openai.auth import DEFAULT_TENANT
from kvpool.router.disagg import REMOTE_DECODE
from tests.router.conftest import RunningRouter, start_router, wait_for_blocks, wait_until
from tests.router.fake_worker import OMITTED, FakeWorker

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "p0",
          "remote_block_ids": [3, 4, 7], "remote_host": "127.0.0.1", "remote_port": 5601,
          "kvpool": {"lease_id": "abc", "num_tokens": 40}}
CHAT_BODY = {"model": "m", "messages": [{"role": "user", "content": "Tell me about the sea."}],
             "max_tokens": 50, "max_completion_tokens": 50, "n": 1, "temperature": 0.5,
             "stream": True, "stream_options": {"include_usage": True}}
COMPLETION_BODY = {"model": "m", "prompt": "The sea is", "max_tokens": 20, "temperature": 0}
KEYS = {"Authorization": "Bearer client-key", "x-api-key": "client-key"}
NO_HEALTH_CHECKS = {"health_check_interval": 3600.0}  # the router learns of failures by use


@pytest.fixture
def make_worker() -> Iterator[Callable[..., FakeWorker]]:
    """`make_worker(name, **script)`: a started `FakeWorker`, stopped at the end."""
    with ExitStack() as stack:

        def start(name: str, **script: Any) -> FakeWorker:
            worker = FakeWorker(name, **script).start()
            stack.callback(worker.stop)
            return worker

        yield start


def disagg_router(prefill: list[FakeWorker], decode: list[FakeWorker], tokenizer: Any = None,
                  **options: Any):
    return start_router([], tokenizer, prefill=tuple(worker.url for worker in prefill),
                        decode=tuple(worker.url for worker in decode), **options)


def post(router: RunningRouter, path: str, body: dict[str, Any] | bytes,
         headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{router.base_url}{path}", content=content, timeout=60,
                      headers={"content-type": "application/json", **(headers or {})})


def test_prefill_gets_one_token_and_decode_the_original_body_with_its_params(make_worker
                                                                             ) -> None:
    prefill, decode = make_worker("p0", params=PARAMS), make_worker("d0")
    with disagg_router([prefill], [decode]) as router:
        raw = json.dumps(CHAT_BODY).encode()
        with httpx.stream("POST", f"{router.base_url}{CHAT}", content=raw, timeout=60,
                          headers={"content-type": "application/json", **KEYS}) as response:
            assert response.status_code == 200
            lines = [line for line in response.iter_lines() if line]
        [sent] = prefill.received
        assert sent.path == CHAT
        expected = {key: value for key, value in CHAT_BODY.items() if key != "stream_options"}
        assert sent.body == {**expected, "stream": False, "max_tokens": 1,
                             "max_completion_tokens": 1, "n": 1,
                             "kv_transfer_params": REMOTE_DECODE}
        [decoded] = decode.received
        assert decoded.path == CHAT
        assert decoded.body == {**CHAT_BODY, "kv_transfer_params": PARAMS}
        for received in (sent, decoded):
            assert received.headers["authorization"] == KEYS["Authorization"]
            assert received.headers["x-api-key"] == KEYS["x-api-key"]
        assert lines[-1] == "data: [DONE]" and len(lines) == 5
        metrics = router.metrics()
        assert metrics["kvpool_router_stage_requests_total{stage=prefill}"] == 1
        assert metrics["kvpool_router_stage_requests_total{stage=decode}"] == 1
        assert metrics["kvpool_router_prefill_duration_seconds_count"] == 1


@pytest.mark.parametrize("params", [None, OMITTED])
def test_without_params_decode_gets_the_body_unchanged(make_worker, params) -> None:
    prefill, decode = make_worker("p0", params=params), make_worker("d0")
    with disagg_router([prefill], [decode]) as router:
        raw = b'{"prompt": "The sea is",   "max_tokens": 20, "n": 2}'  # its own spacing
        response = post(router, COMPLETIONS, raw)
        assert response.status_code == 200
        assert response.json()["choices"][0]["text"] == "Hello, sea!"
        assert prefill.received[0].body["max_tokens"] == 1
        assert prefill.received[0].body["n"] == 1
        assert [received.raw for received in decode.received] == [raw]


def test_the_openai_client_streams_through_in_order_chunk_by_chunk(make_worker) -> None:
    pieces = [f"piece {number} " for number in range(6)]
    prefill = make_worker("p0", params=PARAMS)
    decode = make_worker("d0", pieces=pieces, lockstep=True)
    with disagg_router([prefill], [decode]) as router:
        client = router.client()
        received = []
        for chunk in client.chat.completions.create(model="m", messages=CHAT_BODY["messages"],
                                                    max_tokens=8, stream=True):
            received.append(chunk.choices[0].delta.content)
            decode.ack()  # the next piece is sent only now: this one came on its own
        assert received == pieces
        whole = client.completions.create(model="m", prompt="The sea is", max_tokens=8)
        assert whole.choices[0].text == "".join(pieces)
        assert [len(decode.received), len(prefill.received)] == [2, 2]
        assert decode.received[1].body["kv_transfer_params"] == PARAMS


def test_a_prefill_4xx_is_the_clients_answer_and_no_decode_is_called(make_worker) -> None:
    prefill, decode = make_worker("p0", status=400), make_worker("d0")
    with disagg_router([prefill], [decode]) as router:
        response = post(router, COMPLETIONS, COMPLETION_BODY)
        assert response.status_code == 400
        assert response.json() == {"error": {"message": "scripted 400", "param": None,
                                             "type": "invalid_request_error", "code": 400}}
        assert len(prefill.received) == 1 and decode.received == []
        assert router.metrics()["kvpool_router_stage_requests_total{stage=decode}"] == 0


def test_a_prefill_that_is_down_is_replaced_by_the_other(make_worker) -> None:
    down, up = make_worker("p0", params=PARAMS), make_worker("p1", params={"from": "p1"})
    decode = make_worker("d0")
    with disagg_router([down, up], [decode], **NO_HEALTH_CHECKS) as router:
        down.stop()  # the router has not noticed: its first choice (ties in turn) is refused
        response = post(router, COMPLETIONS, COMPLETION_BODY)
        assert response.status_code == 200
        assert [received.body["kv_transfer_params"] for received in decode.received] \
            == [{"from": "p1"}]
        metrics = router.metrics()
        assert metrics["kvpool_router_retries_total"] == 1
        assert metrics[f"kvpool_router_upstream_errors_total{{kind=connect,replica="
                       f"{down.url}}}"] == 1
        assert not router.replica_status()[down.url]["is_healthy"]


def test_a_prefill_5xx_is_retried_on_the_other_prefill(make_worker) -> None:
    failing, good = make_worker("p0", status=500), make_worker("p1", params=PARAMS)
    decode = make_worker("d0")
    with disagg_router([failing, good], [decode]) as router:
        response = post(router, COMPLETIONS, COMPLETION_BODY)
        assert response.status_code == 200
        assert [len(failing.received), len(good.received)] == [1, 1]
        assert decode.received[0].body["kv_transfer_params"] == PARAMS
        metrics = router.metrics()
        assert metrics[f"kvpool_router_upstream_errors_total{{kind=status,replica="
                       f"{failing.url}}}"] == 1
        assert router.replica_status()[failing.url]["is_healthy"]  # health checks judge it


@pytest.mark.parametrize("num_failing", [1, 2])
def test_with_no_prefill_left_the_client_gets_502(make_worker, num_failing) -> None:
    prefills = [make_worker(f"p{number}", status=503) for number in range(num_failing)]
    decode = make_worker("d0")
    with disagg_router(prefills, [decode]) as router:
        response = post(router, COMPLETIONS, COMPLETION_BODY)
        assert response.status_code == 502
        assert "prefill worker" in response.json()["error"]["message"]
        assert [len(prefill.received) for prefill in prefills] == [1] * num_failing
        assert decode.received == []


def test_a_prefill_answer_off_the_contract_is_502(make_worker) -> None:
    prefill, decode = make_worker("p0", params=[1, 2]), make_worker("d0")
    with disagg_router([prefill], [decode]) as router:
        response = post(router, COMPLETIONS, COMPLETION_BODY)
        assert response.status_code == 502
        assert "kv_transfer_params is a list" in response.json()["error"]["message"]
        assert decode.received == []


def test_a_client_leaving_during_the_prefill_cancels_it(make_worker) -> None:
    prefill, decode = make_worker("p0", is_held=True), make_worker("d0")
    with disagg_router([prefill], [decode]) as router:
        body = json.dumps(COMPLETION_BODY).encode()
        host, port = router.base_url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=30) as client:
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: router\r\n"
                           b"Content-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: prefill.received, what="the prefill hop")
        assert prefill.disconnected.wait(timeout=30)  # the router closed it when we left
        wait_until(lambda: router.state.replicas[prefill.url].num_in_flight == 0)
        assert decode.received == []


def test_a_repeated_prompt_goes_to_the_prefill_worker_holding_it(make_worker, fast_model
                                                                 ) -> None:
    prefills = [make_worker(f"p{number}", params=PARAMS, publishes_events=True)
                for number in range(2)]
    decode = make_worker("d0")
    body = {"prompt": "The sea is wide and deep. " * 12, "max_tokens": 8}
    with disagg_router(prefills, [decode], fast_model.tokenizer) as router:
        for prefill in prefills:  # subscribed, so no batch it publishes from now on is lost
            wait_until(lambda url=prefill.url: router.state.replicas[url].events is not None
                       and router.state.replicas[url].events.stats().is_synced,
                       what="the prefill workers' KV-event feeds")
        assert post(router, COMPLETIONS, body).status_code == 200
        [first] = [prefill for prefill in prefills if prefill.received]
        key = router.state.prompt_key(COMPLETIONS, json.dumps(body).encode(), DEFAULT_TENANT)
        assert len(key.block_hashes) >= 4
        first.store(key.block_hashes)  # as its engine reports the prompt's blocks
        wait_for_blocks(router, first.url, len(key.block_hashes))
        for _ in range(3):
            assert post(router, COMPLETIONS, body).status_code == 200
        assert [len(prefill.received) for prefill in prefills].count(4) == 1
        assert router.decisions()[first.url, "prefix"] == 3
        assert router.decisions()[decode.url, "load"] == 4


def test_models_status_and_health_know_the_roles(make_worker) -> None:
    prefill, decode = make_worker("p0"), make_worker("d0")
    with disagg_router([prefill], [decode], **NO_HEALTH_CHECKS) as router:
        models = httpx.get(f"{router.base_url}/v1/models", timeout=10).json()
        assert [model["id"] for model in models["data"]] == ["d0"]
        status = router.replica_status()
        assert {url: replica["role"] for url, replica in status.items()} \
            == {prefill.url: "prefill", decode.url: "decode"}
        assert status[decode.url]["events"] is None  # chosen by load: no feed asked for
        assert httpx.get(f"{router.base_url}/health", timeout=10).status_code == 200


def test_with_no_decode_worker_in_nothing_is_prefilled(make_worker) -> None:
    prefill, decode = make_worker("p0"), make_worker("d0")
    url = decode.url
    decode.stop()  # down before the router's first health check: never in
    with start_router([], None, prefill=(prefill.url,), decode=(url,)) as router:
        health = httpx.get(f"{router.base_url}/health", timeout=10)
        assert health.status_code == 503
        assert "decode" in health.json()["error"]["message"]
        response = post(router, COMPLETIONS, COMPLETION_BODY)
        assert response.status_code == 503 and response.headers["retry-after"] == "1"
        assert prefill.received == []


def test_a_body_that_is_not_json_goes_straight_to_decode(make_worker) -> None:
    prefill, decode = make_worker("p0"), make_worker("d0")
    with disagg_router([prefill], [decode]) as router:
        response = post(router, COMPLETIONS, b"not json")
        assert response.status_code == 400  # the decode worker's own answer
        assert [received.raw for received in decode.received] == [b"not json"]
        assert prefill.received == []

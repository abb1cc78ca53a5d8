"""Passing requests through the router: a stream arrives chunk by chunk as the replica sends
it, a whole response and a replica's error come back as the replica answered, a client that
leaves aborts its request on the replica (streamed or not), /v1/models comes from a replica,
and with no replica in every request gets 503."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.router.conftest import start_router, wait_until
from tests.server.conftest import MODEL, RunningServer, scrape, slow_steps

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "Write a long poem about the sea."}]


def sse_data(lines: list[str]) -> list[str]:
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def chat_text(events: list[str]) -> str:
    chunks = [json.loads(event) for event in events if event != "[DONE]"]
    return "".join(chunk["choices"][0]["delta"].get("content") or ""
                   for chunk in chunks if chunk["choices"])


def assert_aborted_early(replica: RunningServer) -> None:
    """The replica is idle and generated a fraction of the 2000 tokens asked for (at 20 ms a
    step they take 40 s): it aborted the request when the router let go of it."""
    stats = replica.wait_until_idle(timeout=10)
    assert stats["num_requests_running"] == 0 and stats["num_used_blocks"] == 0
    assert scrape(replica)["kvpool:generation_tokens_total"] < 500


def test_a_stream_passes_through_chunk_by_chunk(make_replica, fast_model) -> None:
    replica = make_replica()
    body = {"model": MODEL, "messages": USER, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True, "stream": True}
    direct = httpx.post(f"{replica.base_url}{CHAT}", json=body, timeout=30)
    slow_steps(replica, 0.03)
    with start_router([replica.base_url], fast_model.tokenizer) as router, \
            httpx.stream("POST", f"{router.base_url}{CHAT}", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        arrivals, lines = [], []
        for line in response.iter_lines():
            arrivals.append(time.monotonic())
            lines.append(line)
    events = sse_data(lines)
    assert events[-1] == "[DONE]" and len(events) > 20
    assert chat_text(events) == chat_text(sse_data(direct.text.splitlines()))
    assert arrivals[-1] - arrivals[0] > 0.4  # 24 steps of 30 ms: not buffered to the end


def test_a_whole_response_and_the_replicas_errors_pass_through(make_replica, fast_model
                                                               ) -> None:
    replica = make_replica()
    bodies = [{"model": MODEL, "prompt": "The sea is", "max_tokens": 8, "temperature": 0},
              {"model": MODEL, "prompt": "The sea is", "max_tokens": -1},
              {"model": "no-such-model", "prompt": "The sea is"},
              {"model": MODEL}]
    with start_router([replica.base_url], fast_model.tokenizer) as router:
        for body in bodies:
            direct = httpx.post(f"{replica.base_url}{COMPLETIONS}", json=body, timeout=30)
            routed = httpx.post(f"{router.base_url}{COMPLETIONS}", json=body, timeout=30)
            assert routed.status_code == direct.status_code
            assert routed.headers["content-type"] == direct.headers["content-type"]
            if direct.status_code == 200:
                assert routed.json()["choices"] == direct.json()["choices"]
            else:
                assert routed.json() == direct.json()
        models = httpx.get(f"{router.base_url}/v1/models", timeout=10)
        assert [model["id"] for model in models.json()["data"]] == [MODEL]
        assert router.metrics()["kvpool_router_requests_total{reason=load,replica="
                                f"{replica.base_url}}}"] == len(bodies)


def test_a_client_leaving_a_stream_aborts_it_on_the_replica(make_replica, fast_model) -> None:
    replica = make_replica()
    slow_steps(replica, 0.02)
    body = {"model": MODEL, "prompt": "The sea", "max_tokens": 2000, "ignore_eos": True,
            "stream": True}
    with start_router([replica.base_url], fast_model.tokenizer) as router:
        with httpx.stream("POST", f"{router.base_url}{COMPLETIONS}", json=body,
                          timeout=30) as response:
            lines = response.iter_lines()
            first = [next(lines) for _ in range(3)]
        assert any(line.startswith("data: ") for line in first)
        assert_aborted_early(replica)
        wait_until(lambda: router.state.replicas[replica.base_url].num_in_flight == 0)


def test_a_client_leaving_before_a_whole_response_aborts_it(make_replica, fast_model) -> None:
    replica = make_replica()
    slow_steps(replica, 0.02)
    body = {"model": MODEL, "prompt": "The sea", "max_tokens": 2000, "ignore_eos": True}
    with start_router([replica.base_url], fast_model.tokenizer) as router:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{router.base_url}{COMPLETIONS}", json=body, timeout=1.0)
        assert_aborted_early(replica)
        wait_until(lambda: router.state.replicas[replica.base_url].num_in_flight == 0)


def test_with_no_replica_in_requests_get_503(fast_model) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with start_router([url], fast_model.tokenizer) as router:
        assert httpx.get(f"{router.base_url}/health").status_code == 503
        response = httpx.post(f"{router.base_url}{COMPLETIONS}",
                              json={"model": MODEL, "prompt": "hi"})
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "server_error"
        assert response.headers["retry-after"] == "1"
        metrics = router.metrics()
        assert metrics["kvpool_router_no_replica_total"] == 1
        assert metrics[f"kvpool_router_replica_healthy{{replica={url}}}"] == 0

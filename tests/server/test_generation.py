"""A request's life on the server: a client that leaves (streaming or not) aborts its request
and its blocks go back to the pool at once; an engine step that fails answers 500 in OpenAI's
shape while the server goes on serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server.conftest import MODEL

LONG = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000}
NO_EOS = {"ignore_eos": True}


@pytest.fixture
def server(make_server):
    return make_server(max_model_len=2048)


def assert_aborted_early(server) -> None:
    """No block in use and far fewer tokens generated than asked for."""
    stats = server.wait_until_idle(timeout=10)
    assert stats["num_used_blocks"] == 0
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert server.engine.snapshot().stats.num_generated_tokens < LONG["max_tokens"]


@pytest.mark.parametrize("options", [{}, {"n": 3, "temperature": 1.0}, {"prompt": ["a", "b c"]}])
def test_closing_a_stream_midway_frees_its_blocks(server, options) -> None:
    stream = server.client().completions.create(
        stream=True, extra_body=NO_EOS, **(LONG | options)
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    assert server.kv_stats()["num_used_blocks"] > 0
    stream.close()
    assert_aborted_early(server)


def test_leaving_a_non_streaming_request_frees_its_blocks(server) -> None:
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.base_url) as http:
        http.post("/v1/completions", json=LONG | NO_EOS, timeout=httpx.Timeout(5, read=0.3))
    assert_aborted_early(server)


def test_leaving_a_chat_stream_frees_its_blocks(server) -> None:
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], stream=True,
        max_tokens=2000, extra_body=NO_EOS,
    )
    next(iter(stream))
    stream.close()
    assert_aborted_early(server)


def _fail_next_step(server) -> None:
    runner = server.engine.engine.runner
    execute = runner.execute

    def failing_execute(*args, **kwargs):
        runner.execute = execute  # only this step fails
        raise RuntimeError("injected failure")

    runner.execute = failing_execute


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(server) -> None:
    client = server.client()
    _fail_next_step(server)
    with pytest.raises(openai.InternalServerError, match="engine failed"):
        client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
    _fail_next_step(server)
    with pytest.raises(openai.APIError, match="engine failed"):
        list(client.completions.create(model=MODEL, prompt="hello", max_tokens=4, stream=True))
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    completion = client.completions.create(model=MODEL, prompt="hello", max_tokens=4,
                                           extra_body=NO_EOS)
    assert completion.usage.completion_tokens == 4
    assert server.engine.snapshot().num_failed_steps == 2
    assert server.wait_until_idle()["num_used_blocks"] == 0


def test_if_the_engine_thread_dies_health_and_requests_say_so(server) -> None:
    scheduler = server.engine.engine.scheduler

    def broken() -> bool:
        raise RuntimeError("injected")

    scheduler.has_unfinished = broken  # the loop's own bookkeeping fails: the thread dies
    with pytest.raises(openai.InternalServerError):
        server.client().completions.create(model=MODEL, prompt="hello", max_tokens=4)
    health = httpx.get(f"{server.base_url}/health")
    assert health.status_code == 503
    assert "the engine thread died: RuntimeError" in health.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as refused:
        server.client().completions.create(model=MODEL, prompt="hello", max_tokens=4)
    assert refused.value.status_code == 503
    assert server.engine.engine.memory_stats().num_used_blocks == 0

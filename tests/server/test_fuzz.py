"""Fuzz the server with schemathesis, from its own OpenAPI schema over real HTTP: whatever the
generated input (valid by the schema, or deliberately not), no response is a 5xx and every error
is OpenAI-shaped (Anthropic-shaped on Anthropic's /v1/messages paths).

Bounded for CI: a fixed number of examples per operation and mode on the fast model, with a
short model length so that even valid requests generate few tokens. (Hypothesis drives the
strategies directly: schemathesis' pytest plugin does not load under pytest 9.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from kvpool.server.config import ServerConfig
from tests.server.conftest import MODEL, RunningServer, serve

MAX_EXAMPLES = {GenerationMode.POSITIVE: 60, GenerationMode.NEGATIVE: 40}  # per operation


@pytest.fixture(scope="module")
def fuzz_server(fast_model) -> Iterator[RunningServer]:
    config = ServerConfig(served_model_names=(MODEL,), max_concurrent_requests=64)
    with serve(fast_model, config, num_gpu_blocks=64, max_model_len=48) as running:
        yield running


def operations(server: RunningServer) -> list[schemathesis.APIOperation]:
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def check_response(case: schemathesis.Case) -> None:
    response = case.call(timeout=30)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.text[:300]}"
    if response.status_code < 400 or case.path == "/metrics":
        return
    body = response.json()
    if case.path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == response.status_code


@pytest.mark.parametrize("mode", list(MAX_EXAMPLES), ids=lambda mode: mode.value)
def test_no_input_makes_a_server_error(fuzz_server: RunningServer, mode: GenerationMode) -> None:
    found = operations(fuzz_server)
    assert {op.path for op in found} >= {"/v1/completions", "/v1/chat/completions", "/health"}
    for operation in found:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing to corrupt in a GET without parameters
        check = given(case=operation.as_strategy(generation_mode=mode))(check_response)
        settings(max_examples=MAX_EXAMPLES[mode], deadline=None, database=None,
                 suppress_health_check=list(HealthCheck))(check)()
    assert fuzz_server.wait_until_idle()["num_used_blocks"] == 0

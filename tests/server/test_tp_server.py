"""A server over a tensor_parallel_size=2 engine (CPU, gloo): the official openai client gets
its completion, and /health answers 503, naming the worker, once a worker is killed.

The model is a tiny random Llama saved as a safetensors checkpoint (tp=2 splits its heads);
it has no tokenizer, so prompts are token ids.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import httpx
import pytest
from openai import OpenAI

from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.model import presets
from kvpool.server.app import build_app
from kvpool.server.background import BackgroundServer
from kvpool.server.config import ServerConfig
from tests.model.hf_checkpoint import save_hf_checkpoint

MODEL = "tiny-tp"


@pytest.fixture
def tp_server(tmp_path) -> Iterator[tuple[str, AsyncLLMEngine]]:
    checkpoint = save_hf_checkpoint(tmp_path / "tiny", presets.preset("tiny"))
    config = EngineConfig(model=str(checkpoint), load_format="safetensors",
                          dtype="float32", tensor_parallel_size=2, num_gpu_blocks=64,
                          distributed_timeout_seconds=10, enable_warmup=False)
    engine = AsyncLLMEngine(LLMEngine(config))
    app = build_app(engine, ServerConfig(served_model_names=(MODEL,)))
    try:
        with BackgroundServer(app) as background:
            yield background.base_url, engine
    finally:
        engine.shutdown()


def test_tp2_serves_the_openai_client_then_reports_a_dead_worker(tp_server):
    base_url, engine = tp_server
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    completion = client.completions.create(model=MODEL, prompt=[5, 17, 42, 7], max_tokens=4,
                                           temperature=0)
    assert completion.usage.completion_tokens == 4
    assert httpx.get(f"{base_url}/health", timeout=10).status_code == 200

    [pid] = engine.engine.workers.pids
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (response := httpx.get(f"{base_url}/health", timeout=10)).status_code == 200:
        assert time.monotonic() < deadline, "/health still ok after the worker died"
        time.sleep(0.1)
    assert response.status_code == 503
    assert "worker rank 1" in response.text
    with pytest.raises(Exception, match=r"worker rank 1|500|503"):
        client.completions.create(model=MODEL, prompt=[5, 17], max_tokens=4)

"""A server over a tensor_parallel_size=2 engine (CPU, gloo): the official openai client gets
its completion, and /health answers 503, naming the worker, once a worker is killed.

The model is a tiny random Llama saved as a safetensors checkpoint (tp=2 splits its heads);
it has no tokenizer, so prompts are token ids.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
from openai import OpenAI
from safetensors.torch import save_file

from kvpool.engine.async_engine import AsyncLLMEngine
from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.model.config import ModelConfig
from kvpool.model.llama import checkpoint_shapes
from kvpool.server.app import build_app
from kvpool.server.background import BackgroundServer
from kvpool.server.config import ServerConfig

MODEL = "tiny-tp"


def save_checkpoint(directory: Path) -> str:
    config = ModelConfig.preset("tiny")
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads, "head_dim": config.head_dim,
        "max_position_embeddings": config.max_position_embeddings, "eos_token_id": 2,
    }))
    generator = torch.Generator().manual_seed(0)
    tensors = {"model." + name: torch.randn(shape, generator=generator) * 0.2
               for name, shape in checkpoint_shapes(config).items()}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return str(directory)


@pytest.fixture
def tp_server(tmp_path) -> Iterator[tuple[str, AsyncLLMEngine]]:
    config = EngineConfig(model=save_checkpoint(tmp_path / "tiny"), load_format="safetensors",
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

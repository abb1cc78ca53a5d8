"""vLLM's serve options over real HTTP: a browser's CORS preflight is answered before
authentication (never a 401) while the real call still needs its key; `max_logprobs` refuses
larger requests with 400; `/tokenizer_info` exists only behind its flag, and needs a key; the
start-up summary's figures; and `kvpool serve --config FILE --model X` as a real process,
logging that summary.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvpool.bench.processes import free_port
from kvpool.openai.auth import ApiKeyTable
from kvpool.server.config import ServerConfig
from kvpool.server.cors import CorsConfig
from kvpool.server.startup import startup_summary
from tests.kvpool_processes import wait_healthy
from tests.server.conftest import MODEL

KEY = "key-a"
PREFLIGHT = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization,content-type"}
BODY = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}


def _config(**options) -> ServerConfig:
    return ServerConfig(served_model_names=(MODEL,), api_keys=ApiKeyTable.from_config([KEY]),
                        **options)


def test_a_preflight_passes_before_auth_and_the_call_still_needs_its_key(make_server):
    server = make_server(_config())
    with server.http() as http:
        preflight = http.options("/v1/completions", headers=PREFLIGHT)
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == "*"
        assert "POST" in preflight.headers["access-control-allow-methods"]
        origin = {"Origin": "https://app.example"}
        refused = http.post("/v1/completions", json=BODY, headers=origin)
        assert refused.status_code == 401  # readable by the page: it carries the CORS header
        assert refused.headers["access-control-allow-origin"] == "*"
        done = http.post("/v1/completions", json=BODY,
                         headers={**origin, "Authorization": f"Bearer {KEY}"})
        assert done.status_code == 200 and done.headers["access-control-allow-origin"] == "*"


def test_named_origins_refuse_the_others(make_server):
    cors = CorsConfig(allowed_origins=("https://app.example",), allow_credentials=True)
    server = make_server(_config(cors=cors))
    with server.http() as http:
        allowed = http.options("/v1/completions", headers=PREFLIGHT)
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
        assert allowed.headers["access-control-allow-credentials"] == "true"
        other = http.options("/v1/completions",
                             headers={**PREFLIGHT, "Origin": "https://evil.example"})
        assert other.status_code == 400
        assert "access-control-allow-origin" not in other.headers


def test_max_logprobs_refuses_larger_requests(make_server):
    server = make_server(ServerConfig(served_model_names=(MODEL,), max_logprobs=3))
    with server.http() as http:
        ok = http.post("/v1/completions", json={**BODY, "logprobs": 3})
        assert ok.status_code == 200
        assert len(ok.json()["choices"][0]["logprobs"]["top_logprobs"][0]) >= 3
        too_many = http.post("/v1/completions", json={**BODY, "logprobs": 4})
        assert too_many.status_code == 400
        assert "logprobs must be in [0, 3]" in too_many.json()["error"]["message"]
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2, "logprobs": True, "top_logprobs": 4}
        assert http.post("/v1/chat/completions", json=chat).status_code == 400


def test_tokenizer_info_is_served_only_behind_its_flag(make_server, fast_model):
    with make_server(ServerConfig(served_model_names=(MODEL,))).http() as http:
        assert http.get("/tokenizer_info").status_code == 404
    server = make_server(_config(enable_tokenizer_info_endpoint=True))
    with server.http() as http:
        assert http.get("/tokenizer_info").status_code == 401
        info = http.get("/tokenizer_info", headers={"Authorization": f"Bearer {KEY}"}).json()
    hf_tokenizer = fast_model.tokenizer.hf_tokenizer
    assert info["tokenizer_class"] == type(hf_tokenizer).__name__
    assert info["eos_token"] == hf_tokenizer.eos_token
    assert info["vocab_size"] == len(hf_tokenizer)
    assert info["chat_template"] == hf_tokenizer.chat_template
    assert "name_or_path" not in info and "tokenizer_file" not in info


def test_the_startup_summary_counts_the_kv_pool(make_server):
    server = make_server(num_gpu_blocks=100, max_model_len=512)
    engine = server.engine.engine
    summary = startup_summary(engine, "smol")
    block_size = engine.memory_stats().block_size
    assert (summary.num_kv_blocks, summary.max_model_len) == (100, 512)
    assert summary.num_kv_tokens == 100 * block_size
    assert summary.max_concurrency == pytest.approx(100 * block_size / 512)
    assert summary.line() == (
        f"model smol, dtype {summary.dtype}, KV cache dtype {summary.kv_cache_dtype}; KV "
        f"cache: 100 blocks of {block_size} tokens = {100 * block_size:,} tokens; maximum "
        f"concurrency for 512 tokens per request: {100 * block_size / 512:.2f}x")


def test_serve_with_a_config_file_and_model_flag_logs_the_summary(tmp_path):
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"load-format: dummy\nport: {port}\nnum-gpu-blocks: 64\n"
                      "enable-warmup: false\nmax-model-len: 256\ndtype: float32\n")
    command = [sys.executable, "-m", "kvpool", "serve", "--model", "tiny", "--config",
               str(config), "--uvicorn-log-level", "info"]
    log = tmp_path / "serve.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, stderr=output,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        wait_healthy(process, f"http://127.0.0.1:{port}", log)
    finally:
        process.terminate()
        process.wait(timeout=60)
    stderr = log.read_text()
    line = next(line for line in stderr.splitlines() if "maximum concurrency" in line)
    assert "model tiny, dtype float32, KV cache dtype float32; KV cache: 64 blocks of" in line
    assert "maximum concurrency for 256 tokens per request:" in line

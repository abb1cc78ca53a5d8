"""`kvpool serve`: its flags, and a real process that shuts down gracefully on SIGTERM: new
requests are refused at once, a request in flight finishes within the grace period, and the
process exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from kvpool.cli import build_parser, main
from kvpool.server.serve import server_config_from_args


def test_flags_build_the_server_config(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("alice:key-a\n")
    args = build_parser().parse_args([
        "serve", "tiny", "--load-format", "dummy", "--served-model-name", "a", "b",
        "--api-key-file", str(keys), "--max-concurrent-requests", "0",
        "--max-request-bytes", "1MiB", "--shutdown-grace-seconds", "5",
    ])
    config = server_config_from_args(args)
    assert config.served_model_names == ("a", "b")
    assert config.api_keys.authenticate("Bearer key-a") == "alice"
    assert config.max_concurrent_requests is None
    assert config.max_request_bytes == 1 << 20
    assert config.shutdown_grace_seconds == 5
    defaults = server_config_from_args(build_parser().parse_args(["serve"]))
    assert defaults.served_model_names == ("SmolLM2-135M-Instruct",)
    assert not defaults.api_keys.is_enabled
    assert (args.host, args.port) == ("127.0.0.1", 8000)


def test_a_bad_key_file_is_a_clear_error(tmp_path: Path, capsys) -> None:
    keys = tmp_path / "keys"
    keys.write_text("no separator here\n")
    argv = ["serve", "tiny", "--load-format", "dummy", "--api-key-file", str(keys)]
    assert main(argv) == 2
    assert "line 1: expected 'tenant:key'" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_health(base_url: str, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        try:
            if httpx.get(f"{base_url}/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("the server never became healthy")


def _stream_events(base_url: str, body: dict, events: list[dict | str]) -> None:
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))


def test_sigterm_finishes_requests_in_flight_and_exits_cleanly() -> None:
    port = _free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "kvpool", "serve", "tiny", "--load-format", "dummy",
               "--port", str(port), "--num-gpu-blocks", "64", "--no-enable-warmup",
               "--shutdown-grace-seconds", "30", "--log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    process = subprocess.Popen(command, stderr=subprocess.PIPE, env=env)
    try:
        _wait_for_health(base_url, process)
        events: list[dict | str] = []
        body = {"prompt": [5, 6, 7], "max_tokens": 400, "ignore_eos": True, "stream": True}
        reader = threading.Thread(target=_stream_events, args=(base_url, body, events))
        reader.start()
        while not events:  # the request is in flight
            time.sleep(0.01)
        process.send_signal(signal.SIGTERM)
        num_events_at_signal = len(events)
        time.sleep(0.3)
        try:
            refused = httpx.post(f"{base_url}/v1/completions", json={"prompt": [1]}, timeout=5)
            assert refused.status_code == 503
        except httpx.TransportError:
            pass  # or the listening socket is already closed: refused either way
        reader.join(timeout=60)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert events[-1] == "[DONE]"
    assert len(events) > num_events_at_signal + 1  # it kept streaming after the signal
    finish_reasons = [e["choices"][0]["finish_reason"] for e in events[:-1] if e["choices"]]
    assert finish_reasons[-1] == "length"

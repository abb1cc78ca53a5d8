"""`kvpool serve` as a real process shuts down gracefully on SIGTERM: new requests are refused at
once, a request in flight finishes within the grace period, and the process exits 0.

(Its flags are tested in tests/cli/test_serve_flags.py.)
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


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
            health = httpx.get(f"{base_url}/health", timeout=5)  # draining: routers look away
            assert health.status_code == 503 and "shutting down" in health.text
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

"""`kvpool serve` as a real process shuts down gracefully on SIGTERM: new requests are refused at
once, a request in flight finishes within the grace period, and the process exits 0.

(Its flags are tested in tests/cli/test_serve_flags.py.)
"""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from tests.kvpool_processes import start_kvpool, wait_healthy


def _stream_events(base_url: str, body: dict, events: list[dict | str]) -> None:
    with httpx.stream("POST", f"{base_url}/v1/completions", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))


def test_sigterm_finishes_requests_in_flight_and_exits_cleanly(tmp_path) -> None:
    log = tmp_path / "serve.log"
    process, base_url = start_kvpool(["serve", "tiny", "--load-format", "dummy",
                                      "--num-gpu-blocks", "64", "--no-enable-warmup",
                                      "--shutdown-grace-seconds", "30"], log)
    try:
        wait_healthy(process, base_url, log)
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

"""`kvpool` commands as separate processes for tests that run them as users do (replicas, a
router, prefill and decode workers): started on a free loopback port with their output in a
log file, and waited for until `/health` answers (the log's tail if they die first)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kvpool.bench.processes import free_port

READY_TIMEOUT_SECONDS = 180.0


def start_kvpool(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """`python -m kvpool ARGS --port P`, its output in `log`: (the process, its base URL)."""
    port = free_port()
    command = [sys.executable, "-m", "kvpool", *args, "--port", str(port),
               "--log-level", "warning"]
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return process, f"http://127.0.0.1:{port}"


def wait_healthy(process: subprocess.Popen, url: str, log: Path) -> None:
    """Return once `url`/health answers 200; AssertionError with the log's tail if the
    process exits or the time runs out first."""
    deadline = time.monotonic() + READY_TIMEOUT_SECONDS
    while time.monotonic() < deadline:
        assert process.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became healthy:\n{log.read_text()[-3000:]}")

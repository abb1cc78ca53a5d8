"""Real server processes for the scale-out benchmark: `kvpool serve`, `kvpool router` and
Debian's `redis-server`, each on a free loopback port, stopped (and waited for) on exit.

A process that exits before it answers, or does not answer within `start_timeout` seconds,
is an error that carries the tail of its log, so a failed start says why.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx

_LOG_TAIL = 2000  # characters of a failed process's log shown in the error


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ManagedProcess:
    """A child process with its output in a temporary log file."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None
                 ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = {**os.environ, **(env or {})}
        # Open for the child's whole life (closed in `stop`), so not a `with` block.
        self._log = tempfile.NamedTemporaryFile(  # noqa: SIM115
            prefix=f"kvpool-{name}-", suffix=".log", delete=False)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, is_ready: Callable[[], bool], start_timeout: float = 120.0) -> None:
        self.process = subprocess.Popen(self.argv, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=self.env)
        deadline = time.monotonic() + start_timeout
        while not is_ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start ({' '.join(self.argv)}):\n"
                                   f"{self.log_tail()}")
            time.sleep(0.1)

    def log_tail(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-_LOG_TAIL:]

    def stop(self) -> None:
        """SIGTERM (a graceful stop), SIGKILL after 20 s; the log file is removed."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)

    def __enter__(self) -> ManagedProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def http_ready(url: str) -> Callable[[], bool]:
    """A readiness probe: GET `url` answers 200."""
    def probe() -> bool:
        try:
            return httpx.get(url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False
    return probe


def start_kvpool(name: str, command: str, args: Sequence[str], port: int,
                 env: dict[str, str] | None = None) -> ManagedProcess:
    """`python -m kvpool <command> … --port PORT`, started and answering /health."""
    process = ManagedProcess(name, [sys.executable, "-m", "kvpool", command, *args,
                                    "--host", "127.0.0.1", "--port", str(port)], env)
    process.start(http_ready(f"http://127.0.0.1:{port}/health"))
    return process


def start_redis(directory: Path, maxmemory: str) -> tuple[ManagedProcess, str]:
    """A private redis-server (no persistence, `allkeys-lru` within `maxmemory`) and its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (Debian: apt-get install "
                           "redis-server; `make setup` does it)")
    port = free_port()
    process = ManagedProcess("redis", [
        binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(directory),
        "--save", "", "--appendonly", "no", "--maxmemory", maxmemory,
        "--maxmemory-policy", "allkeys-lru"])
    process.start(lambda: _redis_answers(port), start_timeout=20)
    return process, f"redis://127.0.0.1:{port}/0"


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False

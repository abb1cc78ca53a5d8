"""A real `redis-server` (Debian's package, installed by `make setup`) on a loopback port.

Each `RedisServer` owns a private directory and port: no persistence (`save ""`, no AOF),
`maxmemory` with `allkeys-lru` as the shared KV tier expects. `stop()` kills it the way a
crash would (SIGKILL); `start()` brings a fresh, empty server back on the same port, as a
restarted Redis without persistence comes back.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import redis

from kvpool.bench.processes import free_port


class RedisServer:
    def __init__(self, directory: Path, maxmemory: str = "256mb") -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make setup` (it installs "
                               "Debian's redis-server package)")
        self.binary = binary
        self.directory = directory
        self.maxmemory = maxmemory
        self.port = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> RedisServer:
        assert self.process is None, "already running"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.directory), "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
             "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.ConnectionError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not start on port {self.port}"
                                       ) from None
                time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server (SIGKILL: no goodbye to its clients) and wait for it."""
        if self.process is not None:
            self.process.kill()
            self.process.wait()
            self.process = None

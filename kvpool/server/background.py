"""`BackgroundServer`: an app served by uvicorn in a daemon thread on a free loopback port.

For `kvpool bench serve` (which can start its own server) and the tests: real HTTP over a real
socket, in the same process as the model (so a model already in memory is reused). The socket
is bound before the thread starts, so the port is known and there is no race for it.
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

STARTUP_TIMEOUT_SECONDS = 60.0


class BackgroundServer:
    """`with BackgroundServer(app) as server: httpx.get(server.base_url + "/health")`."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", graceful_seconds: int = 5) -> None:
        self.app = app
        self.host = host
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port: int = self._socket.getsockname()[1]
        config = uvicorn.Config(
            app, log_level="warning", lifespan="on", timeout_graceful_shutdown=graceful_seconds
        )
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._socket]}, daemon=True,
            name=f"uvicorn-{self.port}",
        )

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the background server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Graceful: stop accepting, let responses finish, run the app's shutdown."""
        self.server.should_exit = True
        self._thread.join()
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

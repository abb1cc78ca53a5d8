"""`GracefulServer`: uvicorn's server, told about shutdown signals and exiting cleanly after.

uvicorn already stops accepting connections on SIGTERM/SIGINT and waits for open ones (up to
`timeout_graceful_shutdown`) before the app's lifespan ends. Two changes: the app hears of the
signal at once (`on_shutdown`, so new requests on kept-alive connections get 503), and the
signal is not re-raised after the shutdown (uvicorn does, which turns a clean exit into death
by SIGTERM).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

import uvicorn

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_shutdown: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_shutdown = on_shutdown

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.on_shutdown()
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals reach only the main thread; whoever runs us stops us
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

"""Calls into the transfer engine under a deadline, so that no transfer hangs its caller.

Mooncake's synchronous transfers bound themselves once a peer's segment is open
(`MC_TRANSFER_TIMEOUT`, at least 5 s), but opening it (the first transfer to a peer: a
handshake on the peer's RPC port, under a lock every other transfer of that engine waits on)
has no bound we set: against a stopped peer it returned only after about 60 s (Mooncake
0.3.13). So each call runs on a daemon thread (the binding releases the GIL while it waits) and
the caller waits at most `timeout_seconds`.

A call that overruns is *abandoned*, not stopped: it may still finish later, and a read may then
still write the local blocks it was reading into. The caller must not reuse those blocks, nor
free the memory, until `wait_abandoned` returns True; `MooncakeTransport.close` waits for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TypeVar

from kvpool.engine.kv_connector.errors import KVTransferError

T = TypeVar("T")


class BoundedCaller:
    """Runs calls on daemon threads and gives up waiting after `timeout_seconds`."""

    def __init__(self, timeout_seconds: float) -> None:
        if timeout_seconds <= 0:
            raise ValueError(f"timeout_seconds must be positive, got {timeout_seconds}")
        self.timeout_seconds = timeout_seconds
        self._lock = threading.Lock()  # callers on several threads share the list
        self._abandoned: list[threading.Thread] = []

    def call(self, what: str, function: Callable[..., T], *args: object) -> T:
        """`function(*args)`, or KVTransferError ("timeout") naming `what` if it has not
        returned within the deadline. Its own exceptions propagate."""
        outcome: list[tuple[bool, object]] = []

        def run() -> None:
            try:
                outcome.append((True, function(*args)))
            except BaseException as error:  # handed to the waiting caller
                outcome.append((False, error))

        thread = threading.Thread(target=run, daemon=True, name="kv-transfer")
        thread.start()
        thread.join(self.timeout_seconds)
        if thread.is_alive():
            with self._lock:
                self._abandoned.append(thread)
            raise KVTransferError("timeout", f"{what} did not finish within "
                                             f"{self.timeout_seconds} s")
        returned, value = outcome[0]
        if not returned:
            raise value  # type: ignore[misc]
        return value  # type: ignore[return-value]

    @property
    def num_abandoned(self) -> int:
        """Calls given up on that are still running."""
        with self._lock:
            self._abandoned = [thread for thread in self._abandoned if thread.is_alive()]
            return len(self._abandoned)

    def wait_abandoned(self, timeout_seconds: float) -> bool:
        """Wait up to `timeout_seconds` for every abandoned call to return; whether they all
        did."""
        deadline = time.monotonic() + timeout_seconds
        with self._lock:
            abandoned = list(self._abandoned)
        for thread in abandoned:
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.num_abandoned == 0

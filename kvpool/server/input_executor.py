"""`FairExecutor`: a fixed number of worker threads running tasks from per-tenant queues, one
tenant at a time in turn, so that one tenant's backlog cannot starve another.

    submit(tenant, fn)  ──▶  queue[tenant] (FIFO)   ring of tenants with work: A → B → C → A …
    worker: take the ring's first tenant, run its oldest task, put the tenant back at the ring's
            end if it has more

A thread pool's one FIFO queue lets a tenant that sends a hundred slow inputs (megabyte
prompts to tokenize, chat templates to render) put another tenant's one small request behind
all of them; here that request waits for at most one task per other tenant with work (per
worker), whatever their backlogs. A tenant also runs at most `max_running_per_tenant` tasks at
once (default: half the workers), so a newcomer usually finds a worker free at once instead of
waiting for one of the busy tenant's slow tasks to end; a tenant at its cap is passed over
(it keeps its place in the ring).

Invariants: a tenant is in the ring exactly when its queue is non-empty; no tenant runs more
than `max_running_per_tenant` tasks; every submitted task runs once, or its future is
cancelled (a caller that cancelled it before it started); after `shutdown` no task starts.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")

_Task = tuple[Future, Callable[..., Any], tuple[Any, ...]]


class FairExecutor:
    """Bounded workers, round-robin over tenants' FIFO queues (module docstring)."""

    def __init__(self, num_workers: int, name: str = "kvpool-input",
                 max_running_per_tenant: int | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"num_workers must be at least 1, got {num_workers}")
        self.num_workers = num_workers
        self.max_running_per_tenant = max_running_per_tenant or max(1, num_workers // 2)
        self._num_running: dict[str, int] = {}  # tenant -> its tasks running now (> 0)
        self._lock = threading.Condition()
        # The ring: tenants with queued tasks, in turn order (first = next served).
        self._queues: OrderedDict[str, deque[_Task]] = OrderedDict()
        self._is_shut_down = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True)
                         for index in range(num_workers)]
        for thread in self._threads:
            thread.start()

    @property
    def num_queued(self) -> int:
        """Tasks waiting for a worker, over all tenants."""
        with self._lock:
            return sum(len(queue) for queue in self._queues.values())

    def submit(self, tenant: str, fn: Callable[..., T], *args: Any) -> Future[T]:
        """Queue `fn(*args)` as `tenant`'s work; its future holds the result or exception.
        RuntimeError after `shutdown`."""
        future: Future[T] = Future()
        with self._lock:
            if self._is_shut_down:
                raise RuntimeError("the input executor has shut down")
            queue = self._queues.get(tenant)
            if queue is None:
                queue = self._queues[tenant] = deque()  # joins the ring at its end
            queue.append((future, fn, args))
            self._lock.notify()
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Start no more tasks: those still queued are cancelled; with `wait`, the running
        ones finish first."""
        with self._lock:
            self._is_shut_down = True
            for queue in self._queues.values():
                for future, _, _ in queue:
                    future.cancel()
            self._queues.clear()
            self._lock.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

    def _next_task(self) -> tuple[str, _Task] | None:
        """The oldest task of the first tenant in the ring below its running cap (the tenant
        moves to the ring's end, or leaves it when this was its last); None once shut down."""
        with self._lock:
            while not self._is_shut_down:
                tenant = self._first_eligible()
                if tenant is not None:
                    queue = self._queues.pop(tenant)
                    task = queue.popleft()
                    if queue:
                        self._queues[tenant] = queue
                    self._num_running[tenant] = self._num_running.get(tenant, 0) + 1
                    return tenant, task
                self._lock.wait()
            return None

    def _first_eligible(self) -> str | None:
        cap = self.max_running_per_tenant
        return next((tenant for tenant in self._queues
                     if self._num_running.get(tenant, 0) < cap), None)

    def _done(self, tenant: str) -> None:
        with self._lock:
            self._num_running[tenant] -= 1
            if not self._num_running[tenant]:
                del self._num_running[tenant]
            self._lock.notify()  # a tenant at its cap may be eligible again

    def _work(self) -> None:
        while (next_task := self._next_task()) is not None:
            tenant, (future, fn, args) = next_task
            try:
                if future.set_running_or_notify_cancel():  # else cancelled while queued
                    _run(future, fn, args)
            finally:
                self._done(tenant)


def _run(future: Future, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        result = fn(*args)
    except BaseException as error:
        future.set_exception(error)
    else:
        future.set_result(result)

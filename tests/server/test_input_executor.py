"""`FairExecutor`: tenants are served in turn (exact order), whatever one tenant's backlog; no
tenant runs more than its share of the workers; a task cancelled while queued never runs;
shutdown cancels what is left."""

from __future__ import annotations

import threading
from concurrent.futures import CancelledError

import pytest

from kvpool.server.input_executor import FairExecutor


def blocked(executor: FairExecutor, tenant: str = "gate") -> threading.Event:
    """Occupy one of the executor's workers (as `tenant`) until the returned event is set."""
    gate, started = threading.Event(), threading.Event()

    def hold() -> None:
        started.set()
        gate.wait()

    executor.submit(tenant, hold)
    started.wait()
    return gate


def test_tenants_take_turns_whatever_their_backlog() -> None:
    executor = FairExecutor(num_workers=1)
    gate = blocked(executor)
    order: list[str] = []
    submitted = ["a1", "a2", "a3", "a4", "b1", "b2", "c1", "a5"]
    futures = [executor.submit(name[0], order.append, name) for name in submitted]
    assert executor.num_queued == 8
    gate.set()
    for future in futures:
        future.result(timeout=10)
    assert order == ["a1", "b1", "c1", "a2", "b2", "a3", "a4", "a5"]
    executor.shutdown()


def test_a_newcomer_waits_one_turn_not_the_backlog() -> None:
    executor = FairExecutor(num_workers=1)
    gate = blocked(executor)
    order: list[str] = []
    backlog = [executor.submit("noisy", order.append, f"noisy{i}") for i in range(100)]
    quiet = executor.submit("quiet", order.append, "quiet")
    gate.set()
    quiet.result(timeout=10)
    for future in backlog:
        future.result(timeout=10)
    assert order.index("quiet") == 1  # after the one noisy task that was first in the ring
    executor.shutdown()


def test_results_exceptions_and_cancellation() -> None:
    executor = FairExecutor(num_workers=1)
    gate = blocked(executor)
    ran: list[str] = []
    cancelled = executor.submit("a", ran.append, "cancelled")
    failing = executor.submit("a", int, "not a number")
    adding = executor.submit("b", sum, [1, 2, 3])
    assert cancelled.cancel()
    gate.set()
    assert adding.result(timeout=10) == 6
    with pytest.raises(ValueError):
        failing.result(timeout=10)
    assert ran == []
    executor.shutdown()


def test_shutdown_cancels_what_is_queued_and_refuses_more() -> None:
    executor = FairExecutor(num_workers=2)
    gates = [blocked(executor, "gate1"), blocked(executor, "gate2")]
    queued = executor.submit("a", print, "never")
    threading.Timer(0.05, lambda: [gate.set() for gate in gates]).start()
    executor.shutdown()
    with pytest.raises(CancelledError):
        queued.result(timeout=1)
    with pytest.raises(RuntimeError, match="shut down"):
        executor.submit("a", print)
    with pytest.raises(ValueError, match="at least 1"):
        FairExecutor(num_workers=0)


def test_a_tenant_runs_at_most_half_the_workers() -> None:
    executor = FairExecutor(num_workers=4)
    assert executor.max_running_per_tenant == 2
    release, running, peak = threading.Event(), [0], [0]
    lock = threading.Lock()

    def slow() -> None:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        release.wait()
        with lock:
            running[0] -= 1

    noisy = [executor.submit("noisy", slow) for _ in range(10)]
    quiet_started = threading.Event()
    quiet = executor.submit("quiet", quiet_started.set)
    assert quiet_started.wait(timeout=10)  # a worker was free: noisy holds only 2 of 4
    quiet.result(timeout=10)
    assert executor.num_queued == 8  # the noisy tasks beyond its 2 wait
    release.set()
    for future in noisy:
        future.result(timeout=10)
    assert peak[0] == 2
    executor.shutdown()

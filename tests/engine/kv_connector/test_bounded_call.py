"""Calls under a deadline: a call that returns or raises in time is transparent; one that
overruns raises KVTransferError ("timeout") and is counted until it returns."""

from __future__ import annotations

import threading

import pytest

from kvpool.engine.kv_connector.bounded_call import BoundedCaller
from kvpool.engine.kv_connector.errors import KVTransferError


def test_a_call_in_time_returns_its_value_or_raises_its_error() -> None:
    caller = BoundedCaller(timeout_seconds=60)

    assert caller.call("addition", lambda a, b: a + b, 2, 3) == 5
    with pytest.raises(ZeroDivisionError):
        caller.call("division", lambda: 1 / 0)
    assert caller.num_abandoned == 0


def test_an_overrunning_call_is_abandoned_until_it_returns() -> None:
    release = threading.Event()
    caller = BoundedCaller(timeout_seconds=0.05)

    with pytest.raises(KVTransferError, match="stuck read did not finish") as caught:
        caller.call("stuck read", release.wait)

    assert caught.value.reason == "timeout"
    assert caller.num_abandoned == 1
    assert not caller.wait_abandoned(0.01)
    release.set()
    assert caller.wait_abandoned(60)
    assert caller.num_abandoned == 0


def test_a_deadline_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        BoundedCaller(timeout_seconds=0)

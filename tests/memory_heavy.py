"""One memory-heavy test at a time across the suite's workers.

The machine has 24 GiB. The dummy 8B model at tensor_parallel_size 2 holds about 16 GiB
(two ranks of 8), and loading a real-shape preset peaks at a few GiB more; run at once on the
two workers, they brought the kernel's out-of-memory killer down on a worker. A test that
needs several GiB takes this lock (a file lock, shared by every process of the run) for its
duration; the others wait for it, and tests that take little memory never do.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from filelock import FileLock

LOCK_PATH = Path(tempfile.gettempdir()) / "kvpool-tests-memory-heavy.lock"


@pytest.fixture
def memory_heavy() -> Iterator[None]:
    """Hold the suite-wide memory-heavy lock for the test (timeout: 30 minutes)."""
    with FileLock(LOCK_PATH, timeout=1800):
        yield

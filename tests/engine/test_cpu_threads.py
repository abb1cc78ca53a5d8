"""The model's CPU thread count: fixed by `cpu_threads`, else following the other processes'
load (`kvpool.engine.cpu_threads`): the governor's decisions on scripted loads, its bounds as
a property, and the real /proc reading beside a real busy process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvpool.engine.config import EngineConfig
from kvpool.engine.cpu_threads import (
    FixedThreads,
    OtherProcessLoad,
    ThreadGovernor,
    reserve_front_end_core,
    thread_policy,
)
from kvpool.engine.engine import LLMEngine
from kvpool.engine.parallel.group import split_threads


class ScriptedLoad:
    """Readings of other processes' busy cores, in order; the CPUs the process may use."""

    def __init__(self, cpus: int, readings: list[float]) -> None:
        self.cpus = set(range(cpus))
        self.readings = iter(readings)

    def sample(self) -> float:
        return next(self.readings)


@pytest.fixture
def torch_threads():
    """Restore torch's thread count after a test that changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def busy_process():
    """Another process keeping one core busy."""
    process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield process
    finally:
        process.kill()
        process.wait()


def test_the_governor_gives_a_busy_core_up_and_takes_it_back():
    calls = []
    governor = ThreadGovernor(2, ScriptedLoad(2, [0.0, 0.7, 1.0, 0.3, 0.0]), interval=0.5,
                              set_threads=calls.append)
    counts = []
    for now in (0.0, 0.1, 0.5, 1.0, 1.5, 2.0):  # 0.1: within the interval, no look
        governor.before_step(now)
        counts.append(governor.threads)
    assert counts == [2, 2, 1, 1, 2, 2]
    assert calls == [1, 2]  # set only when the count changes


def test_the_governor_never_goes_past_the_threads_the_process_started_with():
    calls = []
    governor = ThreadGovernor(2, ScriptedLoad(4, [0.0, 1.0, 2.0, 3.0]), interval=0,
                              set_threads=calls.append)
    counts = []
    for now in range(4):
        governor.before_step(now)
        counts.append(governor.threads)
    assert counts == [2, 2, 2, 1]  # 4 CPUs: two busy ones still leave the ceiling's two free
    assert calls == [1]


@given(ceiling=st.integers(1, 8), cpus=st.integers(1, 8),
       readings=st.lists(st.floats(0, 16), min_size=1, max_size=20))
def test_the_thread_count_stays_between_one_and_the_ceiling(ceiling, cpus, readings):
    governor = ThreadGovernor(ceiling, ScriptedLoad(cpus, readings), interval=0,
                              set_threads=lambda count: None)
    for now in range(len(readings)):
        governor.before_step(now)
        assert 1 <= governor.threads <= ceiling


@pytest.mark.skipif(not OtherProcessLoad.available(), reason="reads Linux's /proc")
def test_a_busy_process_reads_as_a_busy_core(busy_process):
    load = OtherProcessLoad()
    time.sleep(1.0)  # the busy process runs all along, on one core
    assert load.sample() >= 0.5


@pytest.mark.skipif(not OtherProcessLoad.available(), reason="reads Linux's /proc")
def test_the_governor_drops_a_thread_beside_a_busy_process(busy_process, torch_threads):
    torch.set_num_threads(2)
    governor = ThreadGovernor(2, OtherProcessLoad(), interval=0)
    time.sleep(1.0)
    governor.before_step(time.monotonic())
    assert governor.threads == 1 and torch.get_num_threads() == 1


def test_this_processs_own_work_is_not_another_processs_load(tmp_path):
    proc = write_proc(tmp_path, cpu_ticks=(100, 50), own_ticks=(30, 20))
    load = OtherProcessLoad(cpus={0, 1}, proc=proc)
    write_proc(tmp_path, cpu_ticks=(600, 50), own_ticks=(330, 220))  # +500 busy, +500 ours
    assert load.sample() == 0.0
    write_proc(tmp_path, cpu_ticks=(900, 50), own_ticks=(330, 220))  # +300 busy, none ours
    assert load.sample() > 0


def write_proc(root, cpu_ticks: tuple[int, int], own_ticks: tuple[int, int]):
    """A /proc with `stat` (cpu0 busy for cpu_ticks[0] user ticks, cpu1 for [1]; cpu2, which
    the process may not use, always busy) and `self/stat` (utime, stime)."""
    lines = ["cpu  9 9 9 9 9 9 9 9 0 0"]
    lines += [f"cpu{i} {ticks} 0 0 1000 0 0 0 0 0 0"
              for i, ticks in enumerate((*cpu_ticks, 10**6))]
    (root / "stat").write_text("\n".join(lines) + "\nintr 0\n")
    (root / "self").mkdir(exist_ok=True)
    fields = ["S", *["0"] * 10, str(own_ticks[0]), str(own_ticks[1]), *["0"] * 30]
    (root / "self" / "stat").write_text(f"4242 (python (kvpool)) {' '.join(fields)}\n")
    return root


def test_a_fixed_count_is_set_once_and_kept(torch_threads):
    policy = thread_policy(1, torch.device("cpu"))
    assert isinstance(policy, FixedThreads) and torch.get_num_threads() == 1


def test_the_default_governs_a_cpu_engine_that_has_threads_to_give(torch_threads):
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model="tiny", load_format="dummy", dtype="float32",
                                    kv_cache_memory=1 << 22, enable_warmup=False))
    policy = engine.parts.cpu_threads
    assert isinstance(policy, ThreadGovernor) == OtherProcessLoad.available()
    engine.close()


def test_cpu_threads_must_be_a_count():
    with pytest.raises(ValueError, match="cpu_threads must be at least 1, got 0"):
        EngineConfig(cpu_threads=0)


def test_tensor_parallel_ranks_take_cpu_threads_when_given(torch_threads):
    before = torch.get_num_threads()
    assert split_threads(2, cpu_threads=3) == before
    assert torch.get_num_threads() == 3


@pytest.mark.parametrize(("cores", "fixed", "device", "expected"), [
    (8, None, "cpu", 7), (4, None, "cpu", 3), (2, None, "cpu", None), (8, 6, "cpu", None),
    (8, None, "cuda", None),
])
def test_a_server_keeps_a_core_for_its_front_end_where_there_are_several(
        monkeypatch, cores, fixed, device, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    monkeypatch.setattr(torch, "get_num_threads", lambda: cores)
    set_to = []
    monkeypatch.setattr(torch, "set_num_threads", set_to.append)
    assert reserve_front_end_core(fixed, torch.device(device)) == expected
    assert set_to == ([] if expected is None else [expected])

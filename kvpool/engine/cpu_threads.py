"""How many CPU threads the model's ops use, step by step (the `cpu_threads` option).

Why it matters: each of a decode step's few hundred parallel regions (a matmul, a norm) splits
its work evenly over the threads and ends when the last one finishes. When another process
keeps a core busy, the thread on that core waits for the scheduler's next tick, in every
region. Measured on the 2-core development machine (docs/cpu_decode.md): a SmolLM2 decode step
takes 23 ms alone and 98 ms beside one busy process with two threads, but 38 ms with one
thread, which alone takes 32. So the best count follows the load; with this governor the step
takes ~30 ms beside that process and is unchanged alone.

`cpu_threads=N` fixes the count (`torch.set_num_threads(N)`, once, before the model loads).
None, the default, lets `ThreadGovernor` choose before each step, at most every `interval`
seconds: the cores this process may run on, less the cores other processes kept busy since
it last looked (`OtherProcessLoad`), at least 1 and at most the thread count the process
started with (`OMP_NUM_THREADS` or a launcher's choice is never exceeded). Only a CPU engine
without tensor-parallel workers is governed: elsewhere the count is left as it is. Under
tensor parallelism each rank takes `cpu_threads`, or its share of the cores
(`kvpool.engine.parallel.group.split_threads`); the other ranks are processes too, and would
read as load.

A server's model shares its process with the HTTP front end (the event loop, tokenizing,
detokenizing). `reserve_front_end_core`, which `kvpool serve` calls before building its engine,
lowers that ceiling by one core where the process may use `FRONT_END_MIN_CORES` or more, as
vLLM's CPU backend keeps a core for its front end. On two cores a reserved core costs the
model more than the front end gains: `kvpool bench serve` made 163 output tokens/s with one
model thread against 240 with two (docs/cpu_decode.md), so there nothing is reserved.

Invariant: 1 <= the governed thread count <= its ceiling, at every step.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch

# /proc/stat's columns after the CPU's name that are time the CPU was taken: user, nice,
# system, (idle, iowait skipped), irq, softirq, steal (a VM's host running something else).
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


class ThreadPolicy(Protocol):
    def before_step(self, now: float) -> None: ...


class FixedThreads:
    """The thread count as it was set (or left): nothing changes between steps."""

    def before_step(self, now: float) -> None:
        pass


class OtherProcessLoad:
    """Cores that other processes kept busy, on the CPUs this process may use, between one
    `sample()` and the next (Linux: /proc/stat less this process's own /proc/self/stat)."""

    def __init__(self, cpus: set[int] | None = None, proc: Path = Path("/proc")) -> None:
        self.cpus = cpus if cpus is not None else os.sched_getaffinity(0)
        self.proc = proc
        self.ticks_per_second = os.sysconf("SC_CLK_TCK")
        self._last = self._read()

    @classmethod
    def available(cls, proc: Path = Path("/proc")) -> bool:
        return (proc / "stat").is_file() and (proc / "self" / "stat").is_file()

    def sample(self) -> float:
        """Busy cores (fractional) other processes used since the last sample, >= 0."""
        busy, ours, wall = self._read()
        last_busy, last_ours, last_wall = self._last
        self._last = busy, ours, wall
        seconds = wall - last_wall
        if seconds <= 0:
            return 0.0
        return max(0.0, (busy - last_busy - (ours - last_ours)) / self.ticks_per_second
                   / seconds)

    def _read(self) -> tuple[int, int, float]:
        """(ticks the allowed CPUs were busy, ticks this process ran, now)."""
        busy = 0
        for line in (self.proc / "stat").read_text().splitlines():
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in self.cpus:
                columns = rest.split()
                busy += sum(int(columns[i]) for i in _BUSY_COLUMNS if i < len(columns))
        # The fields after the command's closing parenthesis; utime and stime are 14 and 15.
        fields = (self.proc / "self" / "stat").read_text().rpartition(")")[2].split()
        return busy, int(fields[11]) + int(fields[12]), time.monotonic()


class ThreadGovernor:
    """Before a step, at most every `interval` seconds: use the cores other processes leave
    free, between 1 and `ceiling` threads."""

    def __init__(self, ceiling: int, load: OtherProcessLoad, interval: float = 0.5,
                 set_threads: Callable[[int], None] = torch.set_num_threads) -> None:
        if ceiling < 1:
            raise ValueError(f"ceiling must be >= 1, got {ceiling}")
        self.ceiling = ceiling
        self.load = load
        self.interval = interval
        self.set_threads = set_threads
        self.threads = ceiling
        self._last_look = float("-inf")

    def before_step(self, now: float) -> None:
        if now - self._last_look < self.interval:
            return
        self._last_look = now
        free = len(self.load.cpus) - round(self.load.sample())
        threads = min(self.ceiling, max(1, free))
        if threads != self.threads:
            self.set_threads(threads)
            self.threads = threads


FRONT_END_MIN_CORES = 4  # below this many usable cores the model keeps them all


def reserve_front_end_core(cpu_threads: int | None, device: torch.device) -> int | None:
    """Keep one core for a server's front end (module docstring): the model's thread count
    (the governor's ceiling) becomes at most the usable cores less one, where there are at
    least `FRONT_END_MIN_CORES`, the device is the CPU and `cpu_threads` fixed no count.
    Returns the new count, or None where nothing changed."""
    cores = len(os.sched_getaffinity(0))
    if cpu_threads is not None or device.type != "cpu" or cores < FRONT_END_MIN_CORES:
        return None
    threads = min(torch.get_num_threads(), cores - 1)
    torch.set_num_threads(threads)
    return threads


def thread_policy(cpu_threads: int | None, device: torch.device) -> ThreadPolicy:
    """The policy of an engine without tensor-parallel workers (module docstring; with
    workers, each rank's count is fixed: `kvpool.engine.parallel.group.split_threads`). A
    fixed `cpu_threads` is set here."""
    if cpu_threads is not None:
        torch.set_num_threads(cpu_threads)
        return FixedThreads()
    governed = (device.type == "cpu" and torch.get_num_threads() > 1
                and OtherProcessLoad.available())
    if not governed:
        return FixedThreads()
    return ThreadGovernor(torch.get_num_threads(), OtherProcessLoad())

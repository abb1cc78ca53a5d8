"""Rank 0's side of the group: start the workers, talk to them, notice their death, stop them.

`WorkerGroup.start` spawns tp-1 worker processes (torch.multiprocessing, "spawn": a fresh
interpreter each, as vLLM's multiprocessing executor) that rendezvous with this process on a
free loopback port; under torchrun the other ranks already exist, and it only joins them.

Faults, bounded in time: a worker that dies makes rank 0's next collective fail (gloo raises
when a connection closes), one that hangs makes it time out (`distributed_timeout_seconds`).
The step message itself goes over the control group, whose own timeout is days long (idle
workers wait on it), so rank 0 hands it over from a short-lived thread and waits for that at
most `distributed_timeout_seconds`: a worker too hung to take its step cannot hang rank 0;
`fail` turns either into a `WorkerError` naming the dead worker, its pid and exit code when
one has died (its process sentinel says so). After the first failure the group is broken:
every later step raises at once, and `failure_reason` (the engine's health) says why.
`failure_reason` also watches the processes between steps, so an idle engine whose worker
died reports unhealthy without running a step.

`close` (idempotent; the engine calls it at close, garbage collection and exit) sends the
stop message, joins the workers, terminates and then kills stragglers, and leaves the groups.
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
import threading
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as torch_mp

from kvpool.engine.config import EngineConfig
from kvpool.engine.parallel.group import (
    Rendezvous,
    check_gpu_count,
    free_port,
    is_torchrun,
    join,
    leave,
    rank_device,
    split_threads,
    torchrun_rendezvous,
)
from kvpool.engine.parallel.messages import GroupedKVSpec, KVSpec, StepMessage, send
from kvpool.engine.parallel.worker import spawned_worker
from kvpool.model.parallel import TensorParallel

logger = logging.getLogger(__name__)

JOIN_SECONDS = 10.0  # a stopped worker's time to exit before it is terminated, then killed
DEATH_GRACE_SECONDS = 2.0  # after a failed collective: how long to wait to name a dead worker


class WorkerError(RuntimeError):
    """The tensor-parallel group failed (a worker died or hung): the engine cannot step."""


class WorkerGroup:
    """Rank 0's handle on the other ranks of a tensor-parallel engine."""

    def __init__(self, tp: TensorParallel, control: Any, processes: list[Any],
                 num_threads: int, timeout_seconds: float = 60.0) -> None:
        self.tp = tp
        self.control = control
        self.timeout_seconds = timeout_seconds  # the longest wait for a worker to take a step
        self.processes = processes  # rank r is processes[r - 1]; empty under torchrun
        self._num_threads = num_threads  # this process's torch threads before the group
        self._failure: str | None = None
        self._is_closed = False

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> WorkerGroup:
        """Start (or, under torchrun, join) the workers; returns once every rank has joined,
        rank 0's device set. Bounded by `distributed_timeout_seconds`."""
        size, timeout = (config.parallel.tensor_parallel_size,
                         config.parallel.distributed_timeout_seconds)
        if dist.is_initialized():  # before spawning anything
            raise ValueError("this process already belongs to a torch.distributed group: one "
                             "tensor-parallel engine per process (close the other first)")
        if device.type == "cuda" and not is_torchrun():  # torchrun: each rank checks its own
            check_gpu_count(size, torch.cuda.device_count())
        num_threads = split_threads(size, config.load.cpu_threads)
        processes: list[Any] = []
        if is_torchrun():
            rendezvous = torchrun_rendezvous(size, timeout)
            assert rendezvous.rank == 0, "ranks > 0 run the worker loop, not an engine"
        else:
            rendezvous = Rendezvous(f"tcp://127.0.0.1:{free_port()}", 0, size, timeout)
            context = torch_mp.get_context("spawn")
            for rank in range(1, size):
                worker = Rendezvous(rendezvous.init_method, rank, size, timeout)
                process = context.Process(target=spawned_worker, args=(config, worker),
                                          name=f"kvpool-tp-rank{rank}", daemon=True)
                process.start()
                processes.append(process)
        group = cls(TensorParallel(), None, processes, num_threads, timeout)
        try:
            group.tp, group.control = join(rendezvous, rank_device(device, 0),
                                           config.parallel.tensor_parallel_overlap_chunks)
        except BaseException:
            group.close()
            raise
        logger.info("tensor parallel: %d ranks joined (%s)", size, rendezvous.init_method)
        return group

    # -------------------------------------------------------------- messages
    def send_kv_spec(self, spec: KVSpec | GroupedKVSpec) -> None:
        """Tell the workers their KV cache's layout and size (once, before any step)."""
        self._send(spec)

    def send_step(self, message: StepMessage) -> None:
        self._send(message)

    def _send(self, message: Any) -> None:
        """Hand `message` to every worker within `timeout_seconds` (module docstring)."""
        self.check()
        outcome: list[BaseException] = []

        def hand_over() -> None:
            try:
                send(message, self.control)
            except BaseException as error:  # reported to the stepping thread below
                outcome.append(error)

        sender = threading.Thread(target=hand_over, name="kvpool-tp-send", daemon=True)
        sender.start()
        sender.join(self.timeout_seconds)
        if sender.is_alive():
            raise self.fail(TimeoutError(
                f"the workers did not take a step within {self.timeout_seconds:g} s"))
        if outcome:
            raise self.fail(outcome[0]) from outcome[0]

    # ---------------------------------------------------------------- faults
    def check(self) -> None:
        """WorkerError at once if the group has failed (or a worker is gone)."""
        reason = self.failure_reason()
        if reason is not None:
            raise WorkerError(reason)

    def failure_reason(self) -> str | None:
        """Why the group cannot step, or None while it can (cheap: no collective; safe
        from any thread)."""
        if self._failure is None and not self._is_closed:
            dead = self._dead_worker(0.0)
            if dead is not None:
                self._failure = dead
        return self._failure

    def fail(self, error: BaseException) -> WorkerError:
        """Mark the group broken after `error` (a failed collective); the WorkerError names
        the dead worker if one dies within a short grace."""
        if self._failure is None:
            dead = self._dead_worker(DEATH_GRACE_SECONDS)
            cause = dead or (f"a step failed ({type(error).__name__}: {error}); a worker "
                             "is hung or unreachable, or the ranks are out of step")
            self._failure = f"tensor-parallel group broken: {cause}"
            logger.error("%s", self._failure)
        return WorkerError(self._failure)

    def _dead_worker(self, timeout: float) -> str | None:
        """'worker rank r (pid p) exited with ...' for the first worker found dead, waiting
        up to `timeout` seconds for one to die."""
        sentinels = {process.sentinel: rank
                     for rank, process in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels), timeout) if sentinels else []
        if not ready:
            return None
        rank = min(sentinels[sentinel] for sentinel in ready)
        process = self.processes[rank - 1]
        process.join(0.1)  # reaps it, so its exit code is known
        return f"worker rank {rank} (pid {process.pid}) {_describe_exit(process.exitcode)}"

    # -------------------------------------------------------------- shutdown
    def close(self) -> None:
        """Stop the workers and leave the groups (idempotent)."""
        if self._is_closed:
            return
        reason = self.failure_reason()
        self._is_closed = True
        if reason is None and self.control is not None:
            try:
                send(None, self.control)
            except Exception:
                logger.warning("could not send the stop message to the workers", exc_info=True)
        for process in self.processes:
            _stop_process(process)
        try:
            leave()
        finally:
            torch.set_num_threads(self._num_threads)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self.processes]


def _stop_process(process: Any) -> None:
    """Join a worker; terminate it, then kill it, if it does not exit in time."""
    process.join(JOIN_SECONDS)
    if process.is_alive():
        logger.warning("worker %s did not stop: terminating it", process.name)
        process.terminate()
        process.join(JOIN_SECONDS / 2)
    if process.is_alive():
        process.kill()
        process.join()


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is not running"
    if code < 0:
        try:
            return f"was killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"

"""The rendezvous: how the ranks of one tensor-parallel engine find each other.

Two process groups, for two kinds of traffic:

    default group   the model's collectives (all-reduce, gather) inside `forward`: gloo on
                    the CPU, NCCL on CUDA; bounded by `distributed_timeout_seconds`, so a hung
                    peer turns into an error instead of a hang
    control group   gloo, rank 0's step messages to the workers (`broadcast_object_list`).
                    Its timeout is long on purpose: a worker waits on it between steps, and an
                    idle server may send no step for hours. A dead peer still fails it at once
                    (gloo raises when a connection closes).

Joining is start-up, not a collective, and gets its own bound (`JOIN_TIMEOUT`): a spawned
worker first starts a Python, imports torch and kvpool, and in a fresh clone may wait for the
C++ kernels' build lock; on a busy 2-core machine that took longer than the 60 s collective
timeout, and every tensor-parallel test failed with `DistStoreError: wait timeout`. Once every
rank has joined, the default group's timeout drops to `timeout_seconds`.

The port of a spawned group's store is reserved, not just probed: `free_port` keeps the socket
it bound listening, and rank 0's store takes over that socket (`master_listen_fd`), so no other
process can take the port between choosing it and listening on it.

The default group is process-global (torch.distributed's), so a process holds at most one
tensor-parallel engine at a time.
"""

from __future__ import annotations

import os
import socket
import urllib.parse
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvpool.model.parallel import TensorParallel

# Between steps a worker waits on the control group; this is how long it may wait.
CONTROL_TIMEOUT = timedelta(days=7)
# How long the ranks wait for each other to join (module docstring). A worker that dies before
# joining is reported by rank 0 only after this; its own traceback is in the log at once.
JOIN_TIMEOUT = timedelta(minutes=10)

# Ports `free_port` handed out in this process, each held by a bound, listening socket until
# rank 0's `join` passes the socket to its store (which then owns and closes it).
_reserved_listeners: dict[int, socket.socket] = {}


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and as whom one rank joins: `init_method` is tcp://127.0.0.1:PORT (spawned
    workers) or env:// (torchrun: MASTER_ADDR, MASTER_PORT from the environment)."""

    init_method: str
    rank: int
    size: int
    timeout_seconds: float


def free_port() -> int:
    """A loopback TCP port reserved for this process's rendezvous store: the OS picks it, and
    it stays bound and listening here until rank 0 joins on it (connections that arrive first
    wait in the backlog)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = int(sock.getsockname()[1])
    _reserved_listeners[port] = sock
    return port


def is_torchrun() -> bool:
    """Whether torchrun (or another launcher) started this process as one rank of many."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_rendezvous(size: int, timeout_seconds: float) -> Rendezvous:
    """This process's rendezvous under torchrun; ValueError if its world is not `size`."""
    world_size = int(os.environ["WORLD_SIZE"])
    if world_size != size:
        raise ValueError(f"tensor_parallel_size {size} must equal torchrun's world size "
                         f"({world_size}): one rank per shard")
    return Rendezvous("env://", int(os.environ["RANK"]), size, timeout_seconds)


def join(rendezvous: Rendezvous, device: torch.device,
         overlap_chunks: int = 1) -> tuple[TensorParallel, Any]:
    """Join both groups (blocks until every rank has); returns this rank's `TensorParallel`
    (over the default group) and the control group."""
    if dist.is_initialized():
        raise ValueError("this process already belongs to a torch.distributed group: one "
                         "tensor-parallel engine per process (close the other first)")
    backend = "gloo"
    if device.type == "cuda":
        backend = "nccl"
        torch.cuda.set_device(rank_device(device, rendezvous.rank))
    collective_timeout = timedelta(seconds=rendezvous.timeout_seconds)
    join_timeout = max(JOIN_TIMEOUT, collective_timeout)
    dist.init_process_group(backend, rank=rendezvous.rank, world_size=rendezvous.size,
                            timeout=join_timeout, **_meeting_point(rendezvous, join_timeout))
    dist.distributed_c10d._set_pg_timeout(collective_timeout)  # joined: collectives' bound
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rendezvous.rank, rendezvous.size, None, overlap_chunks), control


def _meeting_point(rendezvous: Rendezvous, timeout: timedelta) -> dict[str, Any]:
    """`init_process_group`'s store for a tcp:// rendezvous (rank 0 hosts it, on its reserved
    socket when `free_port` chose the port), else its `init_method` (env://)."""
    url = urllib.parse.urlsplit(rendezvous.init_method)
    if url.scheme != "tcp":
        return {"init_method": rendezvous.init_method}
    is_master = rendezvous.rank == 0
    listener = _reserved_listeners.pop(url.port, None) if is_master else None
    store = dist.TCPStore(url.hostname, url.port, rendezvous.size, is_master, timeout=timeout,
                          wait_for_workers=False,
                          master_listen_fd=None if listener is None else listener.detach())
    return {"store": store}


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device a rank runs on: CUDA ranks each take their own GPU (LOCAL_RANK under
    torchrun, else the rank), CPU ranks share the CPU. Two ranks never share a GPU: NCCL
    refuses a communicator whose ranks sit on one device, after the whole start-up."""
    if device.type != "cuda":
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    check_gpu_count(local_rank + 1, torch.cuda.device_count())
    return torch.device("cuda", local_rank)


def check_gpu_count(num_ranks: int, num_gpus: int) -> None:
    """ValueError unless `num_gpus` visible GPUs give `num_ranks` ranks one each."""
    if num_gpus < num_ranks:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise ValueError(f"tensor_parallel_size needs one GPU per rank on this host: "
                         f"{num_ranks} rank(s), {num_gpus} GPU(s) visible{where}")


def leave() -> None:
    """Destroy this process's groups (nothing if it has none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def split_threads(size: int, cpu_threads: int | None = None) -> int:
    """Give this rank `cpu_threads`, else its share of the CPU cores (ranks on one host would
    otherwise oversubscribe them); returns the thread count it had."""
    previous = torch.get_num_threads()
    torch.set_num_threads(cpu_threads or max(1, (os.cpu_count() or 1) // size))
    return previous

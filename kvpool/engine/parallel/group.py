"""The rendezvous: how the ranks of one tensor-parallel engine find each other.

Two process groups, for two kinds of traffic:

    default group   the model's collectives (all-reduce, gather) inside `forward`: gloo on
                    the CPU, NCCL on CUDA; bounded by `distributed_timeout_seconds`, so a hung
                    peer turns into an error instead of a hang
    control group   gloo, rank 0's step messages to the workers (`broadcast_object_list`).
                    Its timeout is long on purpose: a worker waits on it between steps, and an
                    idle server may send no step for hours. A dead peer still fails it at once
                    (gloo raises when a connection closes).

The default group is process-global (torch.distributed's), so a process holds at most one
tensor-parallel engine at a time.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from kvpool.model.parallel import TensorParallel

# Between steps a worker waits on the control group; this is how long it may wait.
CONTROL_TIMEOUT = timedelta(days=7)


@dataclass(frozen=True, slots=True)
class Rendezvous:
    """Where and as whom one rank joins: `init_method` is tcp://127.0.0.1:PORT (spawned
    workers) or env:// (torchrun: MASTER_ADDR, MASTER_PORT from the environment)."""

    init_method: str
    rank: int
    size: int
    timeout_seconds: float


def free_port() -> int:
    """A loopback TCP port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
    dist.init_process_group(backend, init_method=rendezvous.init_method,
                            rank=rendezvous.rank, world_size=rendezvous.size,
                            timeout=timedelta(seconds=rendezvous.timeout_seconds))
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TensorParallel(rendezvous.rank, rendezvous.size, None, overlap_chunks), control


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device a rank runs on: CUDA ranks each take their own GPU (LOCAL_RANK under
    torchrun, else the rank), CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))


def leave() -> None:
    """Destroy this process's groups (nothing if it has none)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def split_threads(size: int) -> int:
    """Give this rank its share of the CPU cores (ranks on one host would otherwise
    oversubscribe them); returns the thread count it had."""
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    return previous

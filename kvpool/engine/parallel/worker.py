"""A worker rank (1..tp-1): its model shard and KV cache, run step by step as rank 0 says.

    join the groups → load the shard → receive KVSpec → allocate the KV cache →
    loop: receive StepMessage → copy blocks → run the model (its collectives meet rank 0's)
    until the stop message (None)

A worker owns no scheduler, pool or prefix cache: rank 0 decides every block id, and the
worker's KV cache holds the same block ids with this rank's KV heads. Its model returns None
(rank 0 alone gets the logits). Any error ends the process with a non-zero exit code, which
rank 0 sees (its collectives fail, and it watches the process).
"""

from __future__ import annotations

import logging
import sys

import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.model_loading import load_engine_model, resolve_device
from kvpool.engine.model_runner import ModelRunner
from kvpool.engine.parallel.group import Rendezvous, join, leave, rank_device, split_threads
from kvpool.engine.parallel.messages import (
    GroupedKVSpec,
    KVSpec,
    StepMessage,
    inputs_to,
    receive,
)

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig, rendezvous: Rendezvous) -> None:
    """A worker process's whole life (the spawn target, and torchrun's ranks > 0)."""
    split_threads(rendezvous.size, config.load.cpu_threads)
    device = rank_device(resolve_device(config.load.device), rendezvous.rank)
    tp, control = join(rendezvous, device, config.parallel.tensor_parallel_overlap_chunks)
    try:
        loaded = load_engine_model(config, tp, device)
        spec: KVSpec | GroupedKVSpec | None = receive(control)
        if spec is None:  # rank 0 failed to start, and stops the group
            return
        _step_loop(ModelRunner(loaded.model, spec.allocate(device), device), control, device)
    finally:
        leave()


@torch.inference_mode()
def _step_loop(runner: ModelRunner, control: object, device: torch.device) -> None:
    """Run rank 0's steps until it says stop: the same `run_step` as rank 0's (copies first,
    then the shard), whose logits stay None here."""
    while True:
        message: StepMessage | None = receive(control)
        if message is None:
            return
        inputs = None if message.inputs is None else inputs_to(message.inputs, device)
        runner.run_step(message.block_copies, inputs)


def spawned_worker(config: EngineConfig, rendezvous: Rendezvous) -> None:
    """The spawned process's entry: a failure is logged and becomes exit code 1."""
    logging.basicConfig(level=logging.WARNING)
    try:
        run_worker(config, rendezvous)
    except BaseException:
        logger.exception("tensor-parallel worker rank %d failed", rendezvous.rank)
        sys.exit(1)

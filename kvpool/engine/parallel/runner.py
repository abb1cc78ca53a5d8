"""Rank 0's model runner under tensor parallelism: `ModelRunner.execute` itself, with one hook
(`run_step`) that shares every step with the workers first.

    ModelRunner.execute(chunks, block_copies):
        prepare the inputs once → run_step: send (copies, inputs) to the workers, then
        ModelRunner.run_step (copy blocks in rank 0's KV cache, run rank 0's shard) → StepLogits

The workers apply the same copies to their own KV caches and run their shards on the same
inputs; the model's collectives meet inside `forward`, and rank 0's shard returns the full
logits. A failure anywhere (a dead or hung worker) becomes a `WorkerError`, and every later
step raises one at once.
"""

from __future__ import annotations

import torch

from kvpool.engine.model_runner import CausalLM, ModelRunner, StepInputs
from kvpool.engine.parallel.executor import WorkerGroup
from kvpool.engine.parallel.messages import StepMessage, inputs_to
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_cache import KVCache


class TensorParallelRunner(ModelRunner):
    """Runs rank 0's shard, and has the workers run theirs, one step at a time."""

    def __init__(self, model: CausalLM, kv_cache: KVCache, device: torch.device | str,
                 workers: WorkerGroup) -> None:
        super().__init__(model, kv_cache, device)
        self.workers = workers

    def run_step(
        self, block_copies: tuple[BlockCopy, ...], inputs: StepInputs | None
    ) -> torch.Tensor | None:
        """Hand the step to the workers, then run it here (`ModelRunner.run_step`); a failure
        after the hand-over becomes the group's `WorkerError`."""
        cpu = torch.device("cpu")
        self.workers.send_step(StepMessage(block_copies,
                                           None if inputs is None else inputs_to(inputs, cpu)))
        try:
            return super().run_step(block_copies, inputs)
        except Exception as error:
            # A collective failed (a peer died or timed out), or rank 0's shard raised after
            # the workers were given the step: either way the ranks are out of step.
            raise self.workers.fail(error) from error

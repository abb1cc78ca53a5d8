"""Rank 0's model runner under tensor parallelism: the same `execute` as `ModelRunner`, with
every step shared with the workers first.

    execute(chunks, block_copies):
        prepare the inputs once (ModelRunner.prepare) → send (copies, inputs) to the workers →
        copy blocks in rank 0's KV cache → run rank 0's shard → StepLogits, as today

The workers apply the same copies to their own KV caches and run their shards on the same
inputs; the model's collectives meet inside `forward`, and rank 0's shard returns the full
logits. A failure anywhere (a dead or hung worker) becomes a `WorkerError`, and every later
step raises one at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvpool.engine.model_runner import CausalLM, ModelChunk, ModelRunner, StepLogits
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

    @torch.inference_mode()
    def execute(
        self, chunks: Sequence[ModelChunk], block_copies: Sequence[BlockCopy] = ()
    ) -> StepLogits:
        """`ModelRunner.execute` on every rank; WorkerError if the group has failed."""
        inputs = self.prepare(chunks) if chunks else None
        cpu = torch.device("cpu")
        message = StepMessage(tuple(block_copies),
                              None if inputs is None else inputs_to(inputs, cpu))
        self.workers.send_step(message)
        try:
            self.kv_cache.copy_blocks(block_copies)
            if inputs is None:
                empty = torch.empty(0, device=self.device)
                return StepLogits(empty, empty)
            logits = self.model(inputs.token_ids, inputs.positions, self.kv_cache.tensor,
                                inputs.metadata, inputs.logits_indices, self.kv_cache.scales)
        except Exception as error:
            # A collective failed (a peer died or timed out), or rank 0's shard raised after
            # the workers were given the step: either way the ranks are out of step.
            raise self.workers.fail(error) from error
        split = inputs.num_sampling_rows
        return StepLogits(logits[:split], logits[split:])


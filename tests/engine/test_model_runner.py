"""The runner's step on a stand-in model: `execute` prepares once and runs through one hook
(`run_step`), which the tensor-parallel runner overrides instead of copying `execute`."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.model_runner import ModelRunner, SequenceChunk
from kvpool.engine.parallel.runner import TensorParallelRunner
from kvpool.memory.block_table import BlockCopy
from kvpool.memory.kv_cache import KVCache
from kvpool.memory.kv_layout import KVLayout

VOCAB = 5


class RowModel:
    """A `CausalLM` whose logits row i is filled with the flat token index it was asked for."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def __call__(self, token_ids, positions, kv, logits_indices):
        self.calls.append("model")
        return logits_indices.float()[:, None].expand(-1, VOCAB)


class FakeWorkers:
    """What the tensor-parallel runner needs of a `WorkerGroup`."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls
        self.messages = []

    def send_step(self, message) -> None:
        self.calls.append("send")
        self.messages.append(message)

    def fail(self, error: BaseException) -> RuntimeError:
        self.calls.append("fail")
        return RuntimeError(f"group broken: {error}")


def kv_cache() -> KVCache:
    return KVCache(KVLayout(block_size=4), num_blocks=4)


def test_execute_splits_sampling_and_prompt_rows_from_one_model_call():
    calls: list[str] = []
    runner = ModelRunner(RowModel(calls), kv_cache())
    chunks = [SequenceChunk([1, 2, 3], 0, [1], num_samples=2, prompt_logprob_positions=range(1, 3)),
              SequenceChunk([4], 4, [2, 3])]
    logits = runner.execute(chunks)
    assert calls == ["model"]
    # The decode goes first in the flat batch (row 0); the prompt's tokens are rows 1..3.
    assert logits.sampling[:, 0].tolist() == [3.0, 3.0, 0.0]
    assert logits.prompt[:, 0].tolist() == [2.0, 3.0]


def test_a_step_of_copies_only_runs_no_model():
    calls: list[str] = []
    cache = kv_cache()
    cache.tensor[1] = 1.0
    logits = ModelRunner(RowModel(calls), cache).execute([], [BlockCopy(1, 2)])
    assert calls == [] and logits.sampling.numel() == 0
    assert bool((cache.tensor[2] == 1.0).all())


def test_the_tensor_parallel_runner_hooks_into_execute_and_sends_before_it_runs():
    assert "execute" not in TensorParallelRunner.__dict__
    calls: list[str] = []
    workers = FakeWorkers(calls)
    runner = TensorParallelRunner(RowModel(calls), kv_cache(), "cpu", workers)
    logits = runner.execute([SequenceChunk([1, 2], 0, [1])], [BlockCopy(1, 2)])
    assert calls == ["send", "model"]
    message = workers.messages[0]
    assert message.block_copies == (BlockCopy(1, 2),)
    assert message.inputs.token_ids.device == torch.device("cpu")
    assert logits.sampling[:, 0].tolist() == [1.0]
    runner.execute([], [])
    assert workers.messages[-1].inputs is None


def test_a_failure_after_the_hand_over_breaks_the_group():
    calls: list[str] = []

    def broken(*args, **kwargs):
        raise ValueError("a peer closed the connection")

    runner = TensorParallelRunner(broken, kv_cache(), "cpu", FakeWorkers(calls))
    with pytest.raises(RuntimeError, match="group broken: a peer closed"):
        runner.execute([SequenceChunk([1], 0, [1])])
    assert calls == ["send", "fail"]

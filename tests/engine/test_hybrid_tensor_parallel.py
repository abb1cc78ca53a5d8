"""The hybrid KV manager at tensor_parallel_size=2 (CPU, gloo, one spawned worker): the worker
builds the same group views over its own buffer (`GroupedKVSpec`), so a Gemma-3-style model's
greedy tokens at tp=2 equal tp=1's, through chunked prefill, preemption and a prefix hit.
Its own file: one tensor-parallel engine per process at a time."""

from __future__ import annotations

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams
from kvpool.memory.hybrid_memory import HybridKVMemory
from tests.engine.conftest import run_all, token_ids
from tests.engine.test_hybrid_kv import GREEDY, crowd, prompts
from tests.model.test_architectures import save_tiny

LONG = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
OPTIONS = {"load_format": "safetensors", "dtype": "float32", "block_size": 4,
           "num_gpu_blocks": 30, "max_num_batched_tokens": 24, "max_num_seqs": 8,
           "preemption_mode": "recompute", "enable_warmup": False,
           "distributed_timeout_seconds": 600}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    directory = tmp_path_factory.mktemp("gemma3_tp")
    save_tiny(directory, "gemma3_text")  # 4 heads, 2 KV heads: tp=2 splits both
    return str(directory)


def test_tp2_equals_tp1_with_the_hybrid_manager_on(checkpoint):
    outputs = {}
    for size in (1, 2):
        engine = LLMEngine(EngineConfig(model=checkpoint, tensor_parallel_size=size,
                                        **OPTIONS))
        try:
            assert isinstance(engine.kv_memory, HybridKVMemory)
            outputs[size] = token_ids(run_all(engine, prompts(), GREEDY))
            again = run_all(engine, [prompts()[2]], GREEDY)[0]  # its blocks are cached
            assert again.num_cached_tokens > 0
            assert again.outputs[0].token_ids == outputs[size][2]
            outputs[size] += token_ids(run_all(engine, crowd(), LONG))  # preempts
            if size == 2:
                assert engine.kv_memory.layout.num_kv_heads == 1  # each rank: 1 of 2
                assert engine.stats().num_preemptions > 0
            assert engine.memory_stats().num_used_blocks == 0
        finally:
            engine.close()
    assert outputs[2] == outputs[1]

"""Greedy outputs do not depend on how requests are batched, cached, chunked or preempted."""

from __future__ import annotations

import pytest

from tests.engine.conftest import PROMPTS, run_all, token_ids


@pytest.fixture(scope="module")
def reference(smollm2):
    """Each prompt run alone, prefix caching off: the answer every batching must reproduce."""
    from kvpool.engine.config import EngineConfig
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.setup import build_engine_parts

    config = EngineConfig(enable_prefix_caching=False, kv_cache_memory=64 * 2**20)
    engine = LLMEngine(config, build_engine_parts(config, smollm2))
    return [token_ids(run_all(engine, [prompt]))[0] for prompt in PROMPTS]


def test_reference_outputs_are_full_length(reference):
    assert len(reference) == len(PROMPTS) >= 16
    assert all(len(tokens) == 16 for tokens in reference)


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
@pytest.mark.parametrize("enable_chunked_prefill", [True, False])
def test_batched_equals_one_at_a_time(
    make_engine, reference, enable_prefix_caching, enable_chunked_prefill
):
    engine = make_engine(
        enable_prefix_caching=enable_prefix_caching,
        enable_chunked_prefill=enable_chunked_prefill,
        max_num_batched_tokens=256 if enable_chunked_prefill else None,
        max_model_len=2048,
        kv_cache_memory=64 * 2**20,
    )
    assert token_ids(run_all(engine, PROMPTS)) == reference


def test_prefix_cache_hits_on_a_second_run(make_engine, reference):
    engine = make_engine(kv_cache_memory=64 * 2**20)
    run_all(engine, PROMPTS)
    again = run_all(engine, PROMPTS)
    assert token_ids(again) == reference
    long_prompt = again[11]
    assert long_prompt.num_cached_tokens >= len(long_prompt.prompt_token_ids) - 16
    assert engine.memory_stats().prefix_cache_hits_tokens > 0


def test_preemption_under_a_tiny_pool_keeps_outputs(make_engine, reference):
    # 64 blocks of 16 tokens: the longest prompt alone needs ~30, so requests must take turns
    engine = make_engine(num_gpu_blocks=64, max_model_len=1024, enable_prefix_caching=False)
    outputs = run_all(engine, PROMPTS)
    assert engine.stats().num_preemptions > 0
    assert engine.stats().num_recomputed_tokens > 0
    assert token_ids(outputs) == reference

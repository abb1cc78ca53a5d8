"""The engine on an elastic KV pool, and the start-up warm-up.

Greedy outputs must not depend on the pool growing, migrating blocks and shrinking under a
running batch: tiny segments (4 blocks), a lazy start and `idle_seconds=0` force all three
mid-run, and the outputs are compared with a static pool's.
"""

from __future__ import annotations

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.sampling_params import SamplingParams
from tests.engine.conftest import PROMPTS, run_all, token_ids

# Mixed lengths (5 to 228 prompt tokens) and mixed output lengths: requests finish at
# different steps, so blocks free up while others still run and a shrink must migrate.
ELASTIC_PROMPTS = [PROMPTS[index] for index in (0, 5, 2, 8, 14, 10)]
ELASTIC_PARAMS = [
    SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for max_tokens in (3, 14, 6, 10, 2, 12)
]
ELASTIC = {"kv_pool": "elastic", "kv_pool_segment_blocks": 4, "kv_pool_initial_blocks": 0,
           "kv_pool_idle_seconds": 0.0}


@pytest.fixture(scope="module")
def static_reference(smollm2) -> list[list[int]]:
    from kvpool.engine.engine import LLMEngine
    from kvpool.engine.setup import build_engine_parts

    config = EngineConfig(num_gpu_blocks=128, enable_warmup=False)
    engine = LLMEngine(config, build_engine_parts(config, smollm2))
    return token_ids(run_all(engine, ELASTIC_PROMPTS, ELASTIC_PARAMS))


def run_tracking_online_blocks(engine) -> tuple[list[list[int]], list[int]]:
    """Like `run_all`, also recording the blocks online after every step."""
    ids = [engine.add_request(prompt, params).request_id
           for prompt, params in zip(ELASTIC_PROMPTS, ELASTIC_PARAMS, strict=True)]
    finished, online = {}, []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        online.append(engine.kv_pool_stats().num_online_blocks)
    return token_ids([finished[request_id] for request_id in ids]), online


def test_greedy_outputs_match_static_while_the_pool_grows_migrates_and_shrinks(
    make_engine, static_reference
):
    engine = make_engine(num_gpu_blocks=128, **ELASTIC)
    outputs, online = run_tracking_online_blocks(engine)
    assert outputs == static_reference
    stats = engine.kv_pool_stats()
    assert stats.num_grows >= 2 and stats.num_shrinks >= 1 and stats.num_migrated_blocks >= 1
    assert stats.num_online_blocks == 4 * (stats.num_grows - stats.num_shrinks)
    assert stats.num_segments == stats.num_grows - stats.num_shrinks
    assert max(online) > online[-1], "the pool gave memory back before the run ended"
    assert engine.stats().num_preemptions == 0, "it grew instead of preempting"
    engine.kv_memory.check_invariants()


def test_a_spent_budget_still_preempts_and_keeps_outputs(make_engine, static_reference):
    # 20 blocks: the 228-token prompt alone ends up in 16, so another sequence is preempted
    engine = make_engine(num_gpu_blocks=20, **ELASTIC)
    assert token_ids(run_all(engine, ELASTIC_PROMPTS, ELASTIC_PARAMS)) == static_reference
    assert engine.kv_pool_stats().max_num_blocks == 20
    assert engine.stats().num_preemptions > 0
    engine.kv_memory.check_invariants()


@pytest.mark.parametrize("options", [{}, ELASTIC], ids=["static", "elastic-lazy"])
def test_warmup_leaves_a_pristine_pool_and_zero_counters(make_engine, options):
    engine = make_engine(num_gpu_blocks=32, **options)
    assert engine.warmup_seconds > 0
    assert not engine.requests and not engine.has_unfinished_requests()
    stats = engine.stats()
    assert (stats.num_steps, stats.num_prompt_tokens, stats.num_generated_tokens) == (0, 0, 0)
    assert (stats.num_preemptions, stats.peak_used_blocks) == (0, 0)
    assert set(stats.phase_seconds.values()) == {0.0}
    memory = engine.memory_stats()
    assert (memory.num_used_blocks, memory.num_cached_blocks, memory.num_allocations) == (0, 0, 0)
    assert (memory.num_frees, memory.prefix_cache_queries_tokens, memory.num_evictions) == (0, 0, 0)
    assert engine.kv_memory.pool.free_block_ids() == engine.kv_memory.pool.online_block_ids()
    kv = engine.kv_pool_stats()
    assert (kv.num_grows, kv.num_shrinks, kv.num_migrated_blocks) == (0, 0, 0)
    assert kv.num_online_blocks == (0 if options else 32)
    assert engine.add_request([1, 2, 3]).request_id == "0"
    engine.abort_request("0")


def test_warmup_can_be_switched_off(make_engine):
    engine = make_engine(num_gpu_blocks=16, enable_warmup=False)
    assert engine.warmup_seconds == 0.0


def test_static_pool_rejects_elastic_options():
    with pytest.raises(ValueError, match="apply only to kv_pool='elastic'"):
        EngineConfig(kv_pool_segment_blocks=4)
    with pytest.raises(ValueError, match="kv_pool must be one of"):
        EngineConfig(kv_pool="dynamic")
    with pytest.raises(ValueError, match="at least 1"):
        EngineConfig(kv_pool="elastic", kv_pool_segment_blocks=0)

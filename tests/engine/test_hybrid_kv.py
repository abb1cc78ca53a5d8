"""The hybrid KV manager in the engine: sliding-window layers keep only their window's blocks,
and nothing a user sees changes. Tiny random checkpoints written by transformers (Gemma 3: five
sliding layers to one full; Mistral: every layer windowed; Ministral: both, by `layer_types`),
windows of 8 tokens, shorter than the prompts."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch

from kvpool.engine.config import EngineConfig
from kvpool.engine.engine import LLMEngine
from kvpool.engine.sampling_params import SamplingParams
from kvpool.engine.setup import build_engine_parts
from kvpool.formats.kv_media import group_medium
from kvpool.formats.kv_snapshot import KVSnapshot
from kvpool.memory.block_pool import NULL_BLOCK_ID
from kvpool.memory.hybrid_memory import HybridKVMemory
from kvpool.memory.kv_groups import max_concurrency
from kvpool.memory.kv_memory import KVMemory
from kvpool.model.hf_config import config_from_hf
from kvpool.model.loaders import load_model
from tests.engine.conftest import run_all, token_ids
from tests.memory.pool_checks import assert_view_matches_pool
from tests.model.test_architectures import greedy_hf, hf_logits_at, save_tiny

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["gemma3_text", "mistral", "ministral"])
def checkpoint(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf_model = save_tiny(directory, request.param)
    return load_model(str(directory), dtype="float32"), hf_model


def engine_over(loaded, **options) -> LLMEngine:
    config = EngineConfig(**{"dtype": "float32", "enable_warmup": False, "block_size": 4,
                             "kv_cache_memory": 1 << 22, **options})
    return LLMEngine(config, build_engine_parts(config, loaded))


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    lengths = (5, 37, 90, 61)
    found = [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths]
    found.append([*found[2][:44], 7, 8])  # shares 11 blocks with another prompt
    return found


def finish(engine: LLMEngine) -> None:
    assert engine.memory_stats().num_used_blocks == 0
    engine.check_invariants()
    engine.close()


def crowd() -> list[list[int]]:
    """Eight prompts that decode long together: 30 blocks' worth of memory preempts them."""
    generator = torch.Generator().manual_seed(9)
    return [torch.randint(0, 256, (40,), generator=generator).tolist() for _ in range(8)]


@pytest.mark.parametrize(("options", "workload", "max_tokens"), [
    ({}, prompts, 12),
    ({"max_num_batched_tokens": 16}, prompts, 12),  # chunked prefill, chunks past the window
    ({"num_gpu_blocks": 30, "max_num_seqs": 8}, crowd, 60),  # preempted, recomputed
    ({"num_gpu_blocks": 30, "max_num_seqs": 8, "swap_space": 0.01,
      "preemption_mode": "swap"}, crowd, 60),  # preempted, swapped to the host and back
], ids=["batched", "chunked", "preempted", "swapped"])
def test_hybrid_on_and_off_give_transformers_tokens(checkpoint, options, workload, max_tokens):
    loaded, hf_model = checkpoint
    expected = [greedy_hf(hf_model, prompt, max_tokens) for prompt in workload()]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for hybrid in (True, False):
        engine = engine_over(loaded, disable_hybrid_kv_cache_manager=not hybrid, **options)
        assert isinstance(engine.kv_memory, HybridKVMemory if hybrid else KVMemory)
        assert token_ids(run_all(engine, workload(), params)) == expected, f"hybrid={hybrid}"
        if "num_gpu_blocks" in options:
            assert engine.stats().num_preemptions > 0
        if "preemption_mode" in options:
            stats = engine.stats()
            assert stats.num_swap_preemptions > 0 and stats.num_recompute_preemptions == 0
            assert 0 < stats.num_swapped_in_blocks <= stats.num_swapped_out_blocks
        finish(engine)


def test_forked_samples_are_the_same_with_the_hybrid_manager_off(checkpoint):
    loaded, _ = checkpoint
    params = SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=20, ignore_eos=True)
    outputs = {}
    for hybrid in (True, False):
        engine = engine_over(loaded, disable_hybrid_kv_cache_manager=not hybrid)
        done = run_all(engine, prompts()[1:3], params)
        outputs[hybrid] = [[c.token_ids for c in output.outputs] for output in done]
        finish(engine)
    assert outputs[True] == outputs[False]
    assert len({tuple(c) for c in outputs[True][0]}) > 1, "the samples should differ"


def test_a_repeated_long_prompt_hits_the_prefix_cache(checkpoint):
    loaded, _ = checkpoint
    engine = engine_over(loaded)
    prompt = prompts()[2]  # 90 tokens, windows of 8
    first = run_all(engine, [prompt], GREEDY)[0]
    second = run_all(engine, [prompt], GREEDY)[0]
    assert second.num_cached_tokens == 88  # 22 blocks: all but the last token's
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    finish(engine)


def test_sliding_blocks_stay_within_the_window_over_a_long_generation(smollm2):
    """A 2,000-token generation on a window-32 model: its window group holds at most
    ceil(32 / 16) + 1 blocks after every step, the full group one per 16 tokens."""
    import transformers

    hf = transformers.MinistralConfig(
        vocab_size=smollm2.config.vocab_size, hidden_size=32, intermediate_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_hidden_layers=2,
        sliding_window=32, max_position_embeddings=4096,
        layer_types=["sliding_attention", "full_attention"])
    config = dataclasses.replace(config_from_hf(hf.to_dict()), eos_token_ids=())
    loaded = load_model(config, load_format="dummy", seed=1)
    engine = engine_over(loaded, block_size=16, kv_cache_memory=1 << 24)
    engine.add_request({"prompt_token_ids": list(range(1, 41))},
                       SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True))
    full, window = engine.kv_memory.groups
    assert (full.window, window.window) == (None, 32)
    most_held = 0
    while engine.has_unfinished_requests():
        engine.step()
        for request in engine.requests.values():
            for seq in request.sequences:
                full_table, window_table = seq.block_table.tables
                held = len(window_table.live_block_ids)
                assert held <= window.max_live_blocks == 3
                assert full_table.num_blocks == -(-seq.num_computed_tokens // 16)
                assert NULL_BLOCK_ID not in full_table.block_ids
                most_held = max(most_held, held)
    assert most_held == 3
    finish(engine)


def test_max_concurrency_counts_only_the_window(checkpoint):
    loaded, _ = checkpoint
    hybrid, padded = engine_over(loaded), engine_over(loaded,
                                                      disable_hybrid_kv_cache_manager=True)
    memory = hybrid.kv_memory
    expected = max_concurrency(memory.groups, memory.num_usable_bytes, hybrid.max_model_len)
    assert hybrid.memory_stats().max_concurrency == pytest.approx(expected)
    # Ministral's tiny model: 1 full layer and 2 of window 8, at 512 tokens: nearly 3x.
    assert hybrid.memory_stats().max_concurrency > 2.5 * padded.memory_stats().max_concurrency
    finish(hybrid)
    finish(padded)


@pytest.mark.parametrize(("options", "reason"), [
    ({"kv_pool": "elastic"}, "--kv-pool elastic"),
])
def test_what_keeps_one_group_turns_the_hybrid_manager_off_and_says_why(
        checkpoint, options, reason, caplog):
    loaded, _ = checkpoint
    with caplog.at_level(logging.INFO, logger="kvpool.engine.setup"):
        engine = engine_over(loaded, **options)
    assert isinstance(engine.kv_memory, KVMemory)
    assert f"hybrid KV cache manager off ({reason})" in caplog.text
    finish(engine)


def test_drafts_and_the_warm_up_run_on_the_hybrid_pool(checkpoint):
    """Speculative decoding's tentative slots in every group, and the engine's warm-up."""
    loaded, hf_model = checkpoint
    expected = [greedy_hf(hf_model, prompt, 12) for prompt in prompts()]
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
                   "prompt_lookup_min": 1}
    engine = engine_over(loaded, speculative_config=speculative, enable_warmup=True)
    assert isinstance(engine.kv_memory, HybridKVMemory)
    assert token_ids(run_all(engine, prompts(), GREEDY)) == expected
    assert engine.stats().spec_decode.num_draft_tokens > 0
    finish(engine)


def _evict(engine: LLMEngine) -> None:
    """Unrelated prompts through a small pool: every cached block leaves the device."""
    generator = torch.Generator().manual_seed(17)
    run_all(engine, [torch.randint(0, 256, (60,), generator=generator).tolist()
                     for _ in range(6)], GREEDY)


def test_an_evicted_prefix_comes_back_from_every_groups_host_tier(checkpoint):
    """Each group spills its evicted blocks to its own host tier; a repeat reloads them in
    every group and answers as before."""
    loaded, _ = checkpoint
    engine = engine_over(loaded, num_gpu_blocks=40, swap_space=0.01)
    assert isinstance(engine.kv_memory, HybridKVMemory)
    prompt = prompts()[2]  # 90 tokens: 22 full blocks a lookup may serve
    first = run_all(engine, [prompt], GREEDY)[0]
    _evict(engine)
    again = run_all(engine, [prompt], GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    by_tier = engine.stats().cached_tokens_by_tier
    assert by_tier["host"] > 0 and again.num_cached_tokens == sum(by_tier.values())
    for tiers in engine.kv_memory.tiers.groups:
        assert tiers.stats().num_reloaded_blocks["host"] == by_tier["host"] // 4
    finish(engine)


def test_a_restarted_hybrid_engine_finds_every_groups_blocks_on_disk(checkpoint, tmp_path):
    """Each group writes its blocks through to its own disk namespace (its layers named);
    a new engine over the same directory serves the prompt from there."""
    loaded, _ = checkpoint
    options = {"kv_disk_cache": str(tmp_path)}
    prompt = prompts()[2]
    engine = engine_over(loaded, **options)
    first = run_all(engine, [prompt], GREEDY)[0]
    finish(engine)
    namespaces = list(tmp_path.iterdir())
    assert len(namespaces) == len(engine.kv_memory.groups)
    restarted = engine_over(loaded, **options)
    again = run_all(restarted, [prompt], GREEDY)[0]
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert again.num_cached_tokens == 88
    assert restarted.stats().cached_tokens_by_tier["disk"] == 88
    finish(restarted)


def test_the_snapshot_draws_every_groups_pools_exactly(checkpoint):
    """Each group's device and host pools ("device/g1", "host/g1"), each sequence's table per
    group: every view matches its pool at every step, through swaps."""
    loaded, _ = checkpoint
    engine = engine_over(loaded, num_gpu_blocks=30, max_num_seqs=8, swap_space=0.01,
                         preemption_mode="swap")
    for prompt in crowd():
        engine.add_request({"prompt_token_ids": prompt}, SamplingParams(
            temperature=0, max_tokens=60, ignore_eos=True))
    memory, statuses = engine.kv_memory, set()
    while engine.has_unfinished_requests():
        engine.step()
        snapshot = engine.kv_snapshot()
        statuses.update(seq.status for seq in snapshot.sequences)
        names = {group_medium(pool.medium, group) for pool, group in memory.cache_pools()}
        assert set(snapshot.pools) == names
        for pool, group in memory.cache_pools():
            tables = [seq.blocks_in(pool.medium, group) for seq in snapshot.sequences]
            assert_view_matches_pool(snapshot.pools[group_medium(pool.medium, group)], pool,
                                     tables)
        again = KVSnapshot.from_json(json.loads(json.dumps(snapshot.to_json())))
        assert again.sequences == snapshot.sequences
    assert "swapped" in statuses
    finish(engine)


def test_the_kv_trace_names_the_groups_and_follows_each(checkpoint, tmp_path):
    """`--kv-trace` on a hybrid model: the header lists the groups past the first, each
    step's "groups" event their counts (which match the pools at the end), and the block
    events replay the first group's pool."""
    from kvpool.formats.kv_trace import read_kv_trace

    loaded, _ = checkpoint
    path = tmp_path / "trace.jsonl"
    engine = engine_over(loaded, kv_trace=str(path))
    run_all(engine, prompts(), GREEDY)
    memory = engine.kv_memory
    finish(engine)
    trace = read_kv_trace(path)
    others = memory.groups[1:]
    assert [g["window"] for g in trace.header.groups] == [g.window for g in others]
    assert trace.header.bytes_per_block == memory.groups[0].layout.bytes_per_block
    steps = list(trace.of_kind("step"))
    per_group = list(trace.of_kind("groups"))
    assert len(per_group) == (len(steps) if others else 0)  # Mistral: one (window) group
    assert all(len(e["p"]) == len(others) for e in per_group)
    for index in range(len(others)):  # each group past the first used blocks
        assert any(e["p"][index][0] for e in per_group)
    held: dict[int, int] = {}
    for event in trace.of_kind("hit", "alloc", "free", "fork", "preempt", "swap_in"):
        sign = -1 if event["e"] in ("free", "preempt") else 1
        for block_id in event["b"]:
            held[block_id] = held.get(block_id, 0) + sign
    assert not any(held.values())  # every reference the first group took, given back


def test_the_warm_up_measures_swap_rates_on_the_hybrid_pool(checkpoint):
    """`preemption_mode="auto"` with a host tier: the warm-up times copies between the first
    group's pages and its host tier."""
    loaded, _ = checkpoint
    engine = engine_over(loaded, swap_space=0.01, enable_warmup=True)
    assert isinstance(engine.kv_memory, HybridKVMemory)
    rates = engine.scheduler.kv.policy.rates
    assert rates.device_to_host_bytes_per_s > 0 and rates.host_to_device_bytes_per_s > 0
    finish(engine)


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_kv_gives_the_same_tokens_with_the_hybrid_manager_on_and_off(
        checkpoint, kv_cache_dtype):
    """int8 / fp8 codes with each page's scales after them: the same codes and scales as one
    group's cache, so the same tokens, batched and preempted (pages change groups)."""
    loaded, _ = checkpoint
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    outputs = {}
    for hybrid in (True, False):
        engine = engine_over(loaded, kv_cache_dtype=kv_cache_dtype, num_gpu_blocks=36,
                             max_num_seqs=8, disable_hybrid_kv_cache_manager=not hybrid)
        assert isinstance(engine.kv_memory, HybridKVMemory if hybrid else KVMemory)
        outputs[hybrid] = token_ids(run_all(engine, crowd(), params))
        assert engine.stats().num_preemptions > 0
        finish(engine)
    assert outputs[True] == outputs[False]


def plain_beams(hf_model, prompt: list[int], width: int, max_tokens: int) -> list[list[int]]:
    """The textbook beam search on the plain model, one full forward per beam and token (no
    KV cache; transformers' `generate` diverges from the plain model on these sliding-window
    configurations, see `greedy_hf`): each round keeps the `width` best of every beam's
    continuations by summed log probability. Best first."""
    beams = [(0.0, list(prompt))]
    for _ in range(max_tokens):
        candidates = []
        for score, tokens in beams:
            logprobs = torch.log_softmax(hf_logits_at(hf_model, tokens, [len(tokens) - 1])[0], -1)
            top = torch.topk(logprobs, 2 * width)
            candidates += [(score + value, [*tokens, token])
                           for value, token in zip(top.values.tolist(), top.indices.tolist(),
                                                   strict=True)]
        beams = sorted(candidates, key=lambda beam: beam[0], reverse=True)[:width]
    return [tokens[len(prompt):] for _, tokens in beams]


@pytest.mark.parametrize("options", [{}, {"num_gpu_blocks": 26}], ids=["roomy", "tight"])
def test_beams_fork_in_every_group_and_equal_the_plain_models(checkpoint, options):
    """Beam search forks a hybrid model's tables (sliding-window groups included): on and off,
    roomy or tight (26 blocks: beams preempt and sleep), every beam equals the plain model's."""
    loaded, hf_model = checkpoint
    width, max_tokens = 3, 8
    workload = prompts()[1:3]  # 37 and 90 tokens: past the window
    expected = [plain_beams(hf_model, prompt, width, max_tokens) for prompt in workload]
    params = SamplingParams(n=width, use_beam_search=True, temperature=0,
                            max_tokens=max_tokens, ignore_eos=True)
    for hybrid in (True, False):
        engine = engine_over(loaded, disable_hybrid_kv_cache_manager=not hybrid, **options)
        outputs = run_all(engine, workload, params)
        beams = [[list(beam.token_ids) for beam in output.outputs] for output in outputs]
        assert beams == expected, hybrid
        finish(engine)


def test_a_sleeping_beam_that_outgrows_the_pool_ends_and_the_search_ends(checkpoint):
    """24 blocks hold 96 tokens without the hybrid manager; beams of a 90-token prompt that
    grow while asleep (no room is checked for a sleeping beam) would wait forever for room
    that cannot exist: they end at "length" instead, recorded as beams, and the pool idles."""
    loaded, _ = checkpoint
    engine = engine_over(loaded, disable_hybrid_kv_cache_manager=True, num_gpu_blocks=24)
    params = SamplingParams(n=3, use_beam_search=True, temperature=0, max_tokens=8,
                            ignore_eos=True)
    outputs = run_all(engine, prompts()[1:3], params)
    assert all(len(output.outputs) == 3 for output in outputs)
    beams = [beam for output in outputs for beam in output.outputs]
    assert {beam.finish_reason for beam in beams} == {"length"}
    assert any(len(beam.token_ids) < 8 for beam in beams)
    finish(engine)

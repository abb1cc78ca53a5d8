"""The simulator on tiny traces worked out by hand, plus trace I/O (the CLI: tests/cli).

Every scenario uses a one-layer model with one KV head of 64 fp16 values:
1 layer x 2 (K, V) x 1 head x 64 x 2 bytes = 256 bytes per token, and a budget of 16 tokens
(4096 bytes). Memory numbers below are in tokens; fractions divide by 16 per measured step.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvpool.memory.arena_free_list import PlacementPolicy
from kvpool.sim.contiguous import ContiguousStrategy, reserve_exact, reserve_max
from kvpool.sim.model_shape import KVShape
from kvpool.sim.paged import PagedStrategy
from kvpool.sim.roster import build_strategies
from kvpool.sim.simulate import simulate
from kvpool.sim.strategies import SimConfig
from kvpool.sim.trace import Request, add_shared_prefix, load_jsonl, save_jsonl, sharegpt_trace

TINY_SHAPE = KVShape("tiny", num_layers=1, num_kv_heads=1, head_dim=64)
CONFIG = SimConfig(budget_bytes=16 * 256, shape=TINY_SHAPE, max_seq_len=8)
# R0: 3 + 2 = 5 tokens, R1: 2 + 4 = 6, R2: 4 + 2 = 6, all arriving at step 0.
TRACE = [Request(0, 0.0, 3, 2), Request(1, 0.0, 2, 4), Request(2, 0.0, 4, 2)]


def test_tiny_shape_is_256_bytes_per_token() -> None:
    assert TINY_SHAPE.bytes_per_token == 1 * 2 * 1 * 64 * 2 == 256
    assert CONFIG.budget_tokens == 16


def test_contiguous_max_by_hand() -> None:
    # Every sequence reserves 8 tokens, so two fit.
    # step 0: admit R0 [0,8) and R1 [8,16); R2 waits.    held 3+2=5, final 5+6=11, reserved 16
    # step 1: R0 4, R1 3 tokens (R2 waits)                held 7
    # step 2: R0 5 (done), R1 4 (R2 waits)                held 9; R0 frees [0,8)
    # step 3: admit R2 into [0,8); R1 5                   nobody waits from here on
    # step 4: R1 6 (done), R2 5
    # step 5: R2 6 (done)                                 -> 6 steps
    # Memory-bound steps 0..2, in tokens (held / final - held / reserved - final / free):
    #   step 0: 5 / 6 / 5 / 0    step 1: 7 / 4 / 5 / 0    step 2: 9 / 2 / 5 / 0
    result = simulate(TRACE, ContiguousStrategy(CONFIG, "contiguous-max", reserve_max), CONFIG)
    assert result.steps == 6
    assert result.concurrency == [2, 2, 2, 2, 2, 1]
    assert (result.peak_concurrency, result.mean_concurrency) == (2, 11 / 6)
    assert result.num_memory_bound_steps == 3
    assert result.token_state_fraction == (5 + 7 + 9) / 48
    assert result.reservation_fraction == (6 + 4 + 2) / 48
    assert result.internal_fragmentation == (5 + 5 + 5) / 48
    assert (result.free_fraction, result.external_fragmentation) == (0.0, 0.0)
    assert result.num_preemptions == 0
    # Over all 6 steps: held 5, 7, 9, then 5 + 4 (R1, R2), 6 + 5, 6.
    assert result.token_state_fraction_all_steps == (5 + 7 + 9 + 9 + 11 + 6) / 96


def test_contiguous_exact_first_fit_by_hand() -> None:
    # Exact reservations: R0 [0,5), R1 [5,11); R2 needs 6 but only [11,16) (5) is free.
    # step 0: held 5, reserved-ahead 6, free 5 (one range: fragmentation 0)     R2 waits
    # step 1: held 7, ahead 4, free 5                                           R2 waits
    # step 2: held 9, ahead 2, free 5; R0 done, frees [0,5)                     R2 waits
    # step 3: free [0,5) + [11,16) = 10 but the largest range is 5 < 6: R2 still waits
    #         (external fragmentation 1 - 5/10 = 0.5); R1 5 tokens: held 5, ahead 1
    # step 4: R1 6 (done): held 6, ahead 0, free 10, fragmentation 0.5          R2 waits
    # step 5: admit R2 into [0,6); step 6: R2 5; step 7: R2 6 (done)  -> 8 steps
    strategy = ContiguousStrategy(CONFIG, "contiguous-exact-first", reserve_exact,
                                  PlacementPolicy.FIRST_FIT)
    result = simulate(TRACE, strategy, CONFIG)
    assert result.steps == 8
    assert result.concurrency == [2, 2, 2, 1, 1, 1, 1, 1]
    assert result.num_memory_bound_steps == 5
    assert result.token_state_fraction == (5 + 7 + 9 + 5 + 6) / 80
    assert result.reservation_fraction == (6 + 4 + 2 + 1 + 0) / 80
    assert result.internal_fragmentation == 0.0
    assert result.free_fraction == (5 + 5 + 5 + 10 + 10) / 80
    assert result.external_fragmentation == (0 + 0 + 0 + 0.5 + 0.5) / 5


def test_paged_block_size_4_by_hand() -> None:
    # 4 blocks of 4 tokens. Admission takes blocks for the prompt only.
    # step 0: R0 (3) 1 block, R1 (2) 1 block, R2 (4) 1 block; 1 block free.   nobody waits
    # step 1: R0 4, R1 3, R2 5 (takes the last block)
    # step 2: R0 needs a block, none free: preempt the youngest, R2 (keeps its 1 generated
    #         token); R0 5 (done, 2 blocks), R1 4 (1 block). R2 waits: memory-bound.
    #         held 5 + 4 = 9, unfilled 3 slots of 3 used blocks, free 1 block (4)
    # step 3: re-admit R2 with 4 + 1 = 5 tokens (2 blocks); R1 5 takes the last block
    # step 4: R1 6 (done), R2 6 (done)  -> 5 steps
    result = simulate(TRACE, PagedStrategy(CONFIG, block_size=4), CONFIG)
    assert result.steps == 5
    assert result.concurrency == [3, 3, 2, 2, 2]
    assert (result.peak_concurrency, result.mean_concurrency) == (3, 12 / 5)
    assert result.num_preemptions == 1
    assert result.num_memory_bound_steps == 1
    assert result.token_state_fraction == 9 / 16
    assert result.internal_fragmentation == 3 / 16
    assert result.free_fraction == 4 / 16
    assert (result.reservation_fraction, result.external_fragmentation) == (0.0, 0.0)


def test_parallel_sampling_forks_the_prompt_and_copies_on_write() -> None:
    # One request, prompt 6, output 2, n = 2 samples, blocks of 4. Nothing ever waits, so the
    # fractions average all 3 steps.
    # step 0: prompt in blocks A (4) + B (2), shared by both samples: 6 tokens held, 2 slots
    #         unfilled, 2 blocks (8) free
    # step 1: sample 0 copies B to C and appends (C: 3); sample 1 then owns B and appends in
    #         place (B: 3). Blocks A, B, C: 10 held, 2 unfilled, 4 free
    # step 2: B 4, C 4: 12 held, 0 unfilled, 4 free
    config = SimConfig(budget_bytes=16 * 256, shape=TINY_SHAPE, max_seq_len=8, num_samples=2)
    result = simulate([Request(0, 0.0, 6, 2)], PagedStrategy(config, 4, fork_samples=True),
                      config)
    assert result.steps == 3
    assert result.concurrency == [2, 2, 2]
    assert result.token_state_fraction == (6 + 10 + 12) / 48
    assert result.internal_fragmentation == (2 + 2 + 0) / 48
    assert result.free_fraction == (8 + 4 + 4) / 48


def test_prefix_sharing_stores_the_common_system_prompt_once() -> None:
    # Two requests of group 0, prompt 6 of which the first 4 tokens are the shared prefix,
    # output 1, blocks of 4.
    # step 0: R0 takes blocks A (prefix, 4) + B (2); R1 finds A in the prefix cache and takes
    #         only C (2): 8 held, 4 unfilled, 1 block (4) free
    # step 1: B 3, C 3 (both done): 10 held, 2 unfilled, 4 free
    trace = [Request(i, 0.0, 6, 1, prefix_group=0, prefix_len=4) for i in range(2)]
    result = simulate(trace, PagedStrategy(CONFIG, 4, share_prefix=True), CONFIG)
    assert result.steps == 2
    assert result.token_state_fraction == (8 + 10) / 32
    assert result.internal_fragmentation == (4 + 2) / 32
    assert result.free_fraction == (4 + 4) / 32
    unshared = simulate(trace, PagedStrategy(CONFIG, 4), CONFIG)
    assert unshared.token_state_fraction == (12 + 14) / 32  # the prefix stored twice


def test_every_strategy_accounts_for_the_whole_budget() -> None:
    trace = add_shared_prefix(sharegpt_trace(40, seed=1, max_seq_len=400), 2, 64, seed=1,
                              max_seq_len=512)
    config = SimConfig(budget_bytes=4096 * 256, shape=TINY_SHAPE, max_seq_len=512,
                       num_samples=2)
    strategies = build_strategies(config, trace, block_sizes=(1, 16))
    assert [s.name for s in strategies] == [
        "contiguous-max", "contiguous-pow2", "contiguous-exact-first", "contiguous-exact-best",
        "contiguous-exact-worst", "contiguous-classes", "contiguous-exact-compact", "paged-1",
        "paged-16", "paged-16+prefix", "paged-16+fork",
    ]
    for strategy in strategies:
        result = simulate(trace, strategy, config)
        total = (result.token_state_fraction + result.reservation_fraction
                 + result.internal_fragmentation + result.free_fraction)
        assert total == pytest.approx(1.0), strategy.name


def test_requests_that_cannot_fit_raise() -> None:
    with pytest.raises(ValueError, match="max_seq_len"):
        simulate([Request(0, 0.0, 6, 6)], PagedStrategy(CONFIG, 4), CONFIG)
    small = SimConfig(budget_bytes=4 * 256, shape=TINY_SHAPE, max_seq_len=8)
    with pytest.raises(ValueError, match="cannot fit"):
        simulate([Request(0, 0.0, 6, 1)], PagedStrategy(small, 4), small)
    with pytest.raises(ValueError, match="outgrows"):
        simulate([Request(0, 0.0, 3, 3)], PagedStrategy(small, 4), small)


def test_sharegpt_trace_respects_its_limits() -> None:
    trace = sharegpt_trace(2000, seed=0)
    assert all(4 <= r.prompt_len <= 1024 and r.output_len >= 4 for r in trace)
    assert all(r.final_len <= 2048 for r in trace)
    mean_prompt = sum(r.prompt_len for r in trace) / len(trace)
    mean_output = sum(r.output_len for r in trace) / len(trace)
    assert 140 < mean_prompt < 180 and 300 < mean_output < 370  # targets 161.31 and 337.99
    assert trace == sharegpt_trace(2000, seed=0)


def test_jsonl_round_trip_and_errors(tmp_path: Path) -> None:
    trace = [Request(0, 0.0, 10, 5), Request(1, 2.5, 20, 7, prefix_group=3, prefix_len=8)]
    path = tmp_path / "trace.jsonl"
    save_jsonl(trace, path)
    assert load_jsonl(path) == trace
    path.write_text('{"arrival": 0, "prompt_len": 10, "output_len": 5, "prefix_group": 1}\n'
                    '{"arrival": 1, "prompt_len": 10}\n')
    with pytest.raises(ValueError, match=r"trace\.jsonl:2"):
        load_jsonl(path)
    path.write_text('{"arrival": 0, "prompt_len": 10, "output_len": 5, "prefix_group": 1}\n')
    assert load_jsonl(path, default_prefix_len=4)[0].prefix_len == 4

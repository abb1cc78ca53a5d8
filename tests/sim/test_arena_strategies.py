"""The strategies over the simulator's size-class arena, on the tiny trace of test_simulator.py
worked out by hand: `contiguous-classes` and `contiguous-exact-compact`, and how their arena
activity reaches the result, the table and the JSON.

One-layer model, one KV head of 64 fp16 values: 256 bytes per token; a budget of 16 tokens
(4096 bytes). Memory numbers below are in tokens; fractions divide by 16 per measured step.
"""

from __future__ import annotations

from kvpool.memory.arena import FreeRange
from kvpool.sim import report
from kvpool.sim.contiguous import (
    CompactingStrategy,
    ContiguousStrategy,
    SizeClassStrategy,
    reserve_exact,
    reserve_max,
)
from kvpool.sim.model_shape import KVShape
from kvpool.sim.roster import build_strategies
from kvpool.sim.simulate import simulate
from kvpool.sim.size_class_arena import SizeClasses
from kvpool.sim.strategies import SimConfig
from kvpool.sim.trace import Request, sharegpt_trace

TINY_SHAPE = KVShape("tiny", num_layers=1, num_kv_heads=1, head_dim=64)
CONFIG = SimConfig(budget_bytes=16 * 256, shape=TINY_SHAPE, max_seq_len=8)
# R0: 3 + 2 = 5 tokens, R1: 2 + 4 = 6, R2: 4 + 2 = 6, all arriving at step 0.
TRACE = [Request(0, 0.0, 3, 2), Request(1, 0.0, 2, 4), Request(2, 0.0, 4, 2)]
# Classes of 4 and 8 tokens, then 4-token granules.
TINY_CLASSES = SizeClasses(sizes=(4 * 256, 8 * 256), large_granule=4 * 256)


def test_contiguous_classes_by_hand() -> None:
    # Every final length (5, 6, 6) rounds up to the 8-token class, so this runs like
    # contiguous-max, except that the 3 + 2 rounding slots are the arena's waste and R2 reuses
    # R0's range from the class cache instead of carving it:
    # step 0: admit R0 [0,8), R1 [8,16); R2 waits       held 5, ahead 6, rounding 5, free 0
    # step 1: held 7, ahead 4         step 2: held 9, ahead 2; R0 done, [0,8) parked in its cache
    # step 3: R2 takes [0,8) from the cache (a hit); steps 4, 5: R1 then R2 done -> 6 steps
    strategy = SizeClassStrategy(CONFIG, "contiguous-classes", reserve_exact,
                                 classes=TINY_CLASSES)
    result = simulate(TRACE, strategy, CONFIG)
    assert result.steps == 6
    assert result.concurrency == [2, 2, 2, 2, 2, 1]
    assert result.num_memory_bound_steps == 3
    assert result.token_state_fraction == (5 + 7 + 9) / 48
    assert result.reservation_fraction == (6 + 4 + 2) / 48
    assert result.internal_fragmentation == (5 + 5 + 5) / 48
    assert (result.free_fraction, result.external_fragmentation) == (0.0, 0.0)
    assert (result.num_cache_hits, result.num_compactions, result.num_bytes_moved) == (1, 0, 0)
    max_len = simulate(TRACE, ContiguousStrategy(CONFIG, "contiguous-max", reserve_max), CONFIG)
    assert (max_len.steps, max_len.internal_fragmentation) == (6, result.internal_fragmentation)
    assert max_len.num_cache_hits == 0
    # At the end both 8-token ranges wait in the class cache, uncoalesced, counted as free.
    assert strategy.arena.cached_ranges() == [FreeRange(0, 2048), FreeRange(2048, 2048)]
    assert strategy.arena.stats().num_free_bytes == 4096


def test_contiguous_exact_compact_by_hand() -> None:
    # Exact reservations: R0 [0,5), R1 [5,11); R2 needs 6 but only [11,16) (5) is free, and
    # the free total is 5 too, so compacting could not help.
    # step 0: held 5, ahead 6, free 5     step 1: held 7, ahead 4, free 5
    # step 2: held 9, ahead 2, free 5; R0 done, frees [0,5)
    # step 3: free [0,5) + [11,16) = 10 >= 6 but no range holds 6: the arena compacts, R1
    #         slides from [5,11) to [0,6) (6 tokens = 1536 bytes copied), R2 takes [6,12);
    #         nobody waits from here on. (contiguous-exact-first waits two more steps here.)
    # step 4: R1 6 (done), R2 5; step 5: R2 6 (done) -> 6 steps
    strategy = CompactingStrategy(CONFIG, "contiguous-exact-compact", reserve_exact)
    result = simulate(TRACE, strategy, CONFIG)
    assert result.steps == 6
    assert result.concurrency == [2, 2, 2, 2, 2, 1]
    assert result.num_memory_bound_steps == 3
    assert result.token_state_fraction == (5 + 7 + 9) / 48
    assert result.reservation_fraction == (6 + 4 + 2) / 48
    assert result.internal_fragmentation == 0.0
    assert result.free_fraction == (5 + 5 + 5) / 48
    assert result.external_fragmentation == 0.0
    assert (result.num_cache_hits, result.num_compactions, result.num_bytes_moved) == (
        0, 1, 6 * 256
    )
    strategy.arena.check_invariants()


def test_new_strategies_are_in_the_roster_and_reach_the_table_and_json() -> None:
    trace = sharegpt_trace(60, seed=2, max_seq_len=512)
    config = SimConfig(budget_bytes=4096 * 256, shape=TINY_SHAPE, max_seq_len=512)
    strategies = [s for s in build_strategies(config, trace, block_sizes=(16,))
                  if s.name in ("contiguous-exact-best", "contiguous-exact-compact")]
    results = [simulate(trace, strategy, config) for strategy in strategies]
    exact, compact = results
    assert compact.num_compactions > 0 and compact.num_bytes_moved > 0
    assert exact.num_compactions == exact.num_bytes_moved == 0
    table = report.format_table(results)
    assert "moved GiB" in table.splitlines()[0]
    rows = report.to_json(results)
    assert rows[1]["num_bytes_moved"] == compact.num_bytes_moved
    assert {"num_cache_hits", "num_compactions"} <= rows[0].keys()

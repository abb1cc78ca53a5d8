"""The preemption policy (swap or recompute, by measured cost) and the scheduler's thrashing
guard, without a model."""

from __future__ import annotations

import pytest

from kvpool.engine.config import EngineConfig
from kvpool.engine.kv_manager import KVCacheManager
from kvpool.engine.preemption import (
    HYSTERESIS_STEPS,
    RECOMPUTE,
    SWAP,
    PreemptionPolicy,
    TransferRates,
)
from kvpool.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from kvpool.engine.sequence import FinishReason
from kvpool.memory.kv_layout import KVLayout
from kvpool.memory.kv_memory import KVMemory
from tests.engine.test_scheduler import BLOCK_SIZE, NeverStop, add, run_step

# 1 GB/s each way and 1 GFLOP/s; a block is 1 MB and recomputing a token costs 1 MFLOP.
RATES = TransferRates(1e9, 1e9, 1e9)


def policy(mode: str = "auto") -> PreemptionPolicy:
    chosen = PreemptionPolicy(mode, bytes_per_block=10**6,
                              prefill_flops=lambda num_tokens: num_tokens * 1e6)
    chosen.rates = RATES
    return chosen


def test_auto_picks_the_cheaper_of_copying_and_recomputing():
    # 4 blocks: 8 ms of copies out and back; 16 tokens: 16 ms of prefill -> swap.
    assert policy().swap_seconds(4) == pytest.approx(8e-3)
    assert policy().recompute_seconds(16) == pytest.approx(16e-3)
    assert policy().choose(num_blocks=4, num_computed_tokens=16) == SWAP
    # Same blocks, 4 tokens computed: 4 ms to recompute beats 8 ms of copies.
    assert policy().choose(num_blocks=4, num_computed_tokens=4) == RECOMPUTE


def test_fixed_modes_ignore_the_costs():
    assert policy("swap").choose(4, 4) == SWAP
    assert policy("recompute").choose(4, 16) == RECOMPUTE


def test_nothing_computed_is_never_swapped_and_unmeasured_auto_swaps():
    unmeasured = PreemptionPolicy("auto", 10**6, lambda num_tokens: num_tokens * 1e6)
    assert unmeasured.choose(4, 0) == RECOMPUTE
    assert unmeasured.choose(4, 16) == SWAP


def swapping_scheduler(num_blocks: int = 4, host_blocks: int = 16) -> Scheduler:
    layout = KVLayout(BLOCK_SIZE)
    memory = KVMemory(layout, num_blocks, host_num_bytes=(host_blocks + 1) * 8)
    manager = KVCacheManager(memory, PreemptionPolicy(SWAP, layout.bytes_per_block, len))
    return Scheduler(SchedulerConfig(), manager, NeverStop())


def test_a_swapped_sequence_resumes_where_it_stopped():
    scheduler = swapping_scheduler()
    first, second = add(scheduler, 8), add(scheduler, 8)
    run_step(scheduler)  # both prefilled: 2 full blocks each, the pool is full
    output = run_step(scheduler)  # both need a new block: the later arrival is swapped out
    assert output.preempted == [second]
    assert scheduler.kv.is_swapped(second) and second.num_computed_tokens == 8
    assert len(scheduler.waiting) == 1
    scheduler.finish(first, FinishReason.STOP)
    resumed = run_step(scheduler)
    assert [(chunk.seq, chunk.num_computed_tokens, chunk.num_new_tokens)
            for chunk in resumed.chunks] == [(second, 8, 1)]  # one decode, nothing recomputed
    assert scheduler.kv.counters.num_recompute_tokens_avoided == 8
    assert scheduler.num_recomputed_tokens == 0


def test_a_sequence_preempted_twice_lately_is_passed_over_as_a_victim():
    scheduler = swapping_scheduler(num_blocks=6)
    early, middle, late = add(scheduler, 3), add(scheduler, 3), add(scheduler, 3)
    run_step(scheduler)
    for _ in range(2):
        scheduler._preempt(late, SchedulerOutput())  # twice, just now
        run_step(scheduler)
    assert scheduler.recently_preempted(late) and not scheduler.recently_preempted(middle)
    assert scheduler._pick_victim(early) is middle  # the tail, `late`, is passed over
    scheduler._num_schedules += HYSTERESIS_STEPS
    assert not scheduler.recently_preempted(late)
    assert scheduler._pick_victim(early) is late


@pytest.mark.parametrize(("options", "message"), [
    ({"preemption_mode": "swap"}, "needs a host tier"),
    ({"preemption_mode": "sometimes"}, "preemption_mode must be one of"),
    ({"swap_space": -1}, "swap_space must be >= 0"),
    ({"swap_space": float("nan")}, "swap_space must be >= 0"),
    ({"kv_disk_cache": "/tmp/x", "enable_prefix_caching": False}, "needs enable_prefix_caching"),
    ({"kv_disk_cache_size": 0}, "kv_disk_cache_size must be at least 1"),
])
def test_bad_tier_options_fail_when_the_config_is_built(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)

"""The roster of strategies one simulation compares (`build_strategies`).

It imports the strategies (`contiguous`, `paged`), which import only the interface
(`strategies`): the arrows go roster → strategies → interface, never back.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvpool.memory.arena import PlacementPolicy
from kvpool.sim.contiguous import (
    CompactingStrategy,
    ContiguousStrategy,
    SizeClassStrategy,
    reserve_exact,
    reserve_max,
    reserve_pow2,
)
from kvpool.sim.paged import PagedStrategy
from kvpool.sim.strategies import SimConfig, Strategy
from kvpool.sim.trace import Request

DEFAULT_BLOCK_SIZES = (1, 8, 16, 32, 64, 128)
SHARING_BLOCK_SIZE = 16  # vLLM's default block size


def build_strategies(config: SimConfig, trace: Sequence[Request],
                     block_sizes: Sequence[int] = DEFAULT_BLOCK_SIZES) -> list[Strategy]:
    """The roster: contiguous baselines (with size classes and with compaction), paged per
    block size, and the sharing variants that have something to share on this trace (prefix
    groups present, or more than one sample)."""
    strategies: list[Strategy] = [
        ContiguousStrategy(config, "contiguous-max", reserve_max),
        ContiguousStrategy(config, "contiguous-pow2", reserve_pow2),
    ]
    strategies += [ContiguousStrategy(config, f"contiguous-exact-{policy.value}", reserve_exact,
                                      policy)
                   for policy in PlacementPolicy]
    strategies += [
        SizeClassStrategy(config, "contiguous-classes", reserve_exact),
        CompactingStrategy(config, "contiguous-exact-compact", reserve_exact),
    ]
    strategies += [PagedStrategy(config, block_size) for block_size in block_sizes]
    if any(request.prefix_group is not None for request in trace):
        strategies.append(PagedStrategy(config, SHARING_BLOCK_SIZE, share_prefix=True))
    if config.num_samples > 1:
        strategies.append(PagedStrategy(config, SHARING_BLOCK_SIZE, fork_samples=True))
    return strategies

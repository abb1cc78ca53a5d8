"""The engine's counters as one record (`LLMEngine.stats()`), for reports, benchmarks and
metrics; `swap_stats` turns the KV manager's preemption and tier counters into its fields
(bytes derived from blocks: `KVLayout.bytes_per_block` is their one owner)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvpool.engine.kv_manager import SwapCounters


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Counters over the engine's life, for reports and metrics."""

    num_steps: int
    num_preemptions: int
    num_recomputed_tokens: int
    peak_used_blocks: int
    num_prompt_tokens: int
    num_generated_tokens: int
    phase_seconds: dict[str, float]  # wall time per step phase: schedule, model, sample, output
    decode_only_model_seconds: float  # the part of phase "model" in steps with no prefill chunk
    num_recompute_preemptions: int  # preemptions whose KV was dropped
    num_swap_preemptions: int  # preemptions whose KV went to the host tier
    num_swapped_out_blocks: int
    num_swapped_out_bytes: int
    num_swapped_in_blocks: int
    num_swapped_in_bytes: int
    num_recompute_tokens_avoided: int  # computed tokens swapped sequences resumed with
    cached_tokens_by_tier: dict[str, int]  # prompt tokens served from "device", "host", "disk"

    def swap_fields(self) -> dict:
        """The preemption-by-kind and tier fields (`swap_stats`' names), for reports."""
        return {name: getattr(self, name) for name in SWAP_FIELDS}



def swap_stats(counters: SwapCounters, bytes_per_block: int) -> dict:
    """`EngineStats`' preemption and tier fields (`SWAP_FIELDS`) from the KV manager's
    counters."""
    return {
        "num_recompute_preemptions": counters.num_recompute_preemptions,
        "num_swap_preemptions": counters.num_swap_preemptions,
        "num_swapped_out_blocks": counters.num_swapped_out_blocks,
        "num_swapped_out_bytes": counters.num_swapped_out_blocks * bytes_per_block,
        "num_swapped_in_blocks": counters.num_swapped_in_blocks,
        "num_swapped_in_bytes": counters.num_swapped_in_blocks * bytes_per_block,
        "num_recompute_tokens_avoided": counters.num_recompute_tokens_avoided,
        "cached_tokens_by_tier": dict(counters.cached_tokens_by_tier),
    }


SWAP_FIELDS = tuple(swap_stats(SwapCounters(), 0))


class PhaseClock:
    """Adds the wall time since the previous lap to a named phase."""

    def __init__(self, totals: dict[str, float]) -> None:
        self.totals = totals
        self.last = time.perf_counter()

    def lap(self, phase: str) -> float:
        """Charge the time since the previous lap to `phase`; return it (seconds)."""
        now = time.perf_counter()
        seconds = now - self.last
        self.totals[phase] += seconds
        self.last = now
        return seconds

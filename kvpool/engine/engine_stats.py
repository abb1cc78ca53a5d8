"""The engine's counters: `StepStats` counts as steps run, `EngineStats` is their record
(`LLMEngine.stats()`) for reports, benchmarks and metrics; `swap_stats` turns the KV manager's
preemption and tier counters into its fields (bytes derived from blocks:
`KVLayout.bytes_per_block` is their one owner).

Invariant: `StepStats`' phase seconds only grow between resets, and a step counts once, when
its model ran (a step with nothing to run, or one rolled back, is not counted)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvpool.engine.kv_manager import SwapCounters
from kvpool.engine.speculative.stats import SpecDecodeStats


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
    spec_decode: SpecDecodeStats  # drafts and acceptance (all zero with speculation off)

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


PHASES = ("schedule", "model", "sample", "output")  # a step's phases, in order


class StepStats:
    """What the engine's steps did since the last reset: steps, tokens, peak blocks, and the
    wall time of each phase (`PhaseClock` charges it)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.num_steps = 0
        self.peak_used_blocks = 0
        self.num_prompt_tokens = 0
        self.phase_seconds = dict.fromkeys(PHASES, 0.0)
        self.decode_only_model_seconds = 0.0

    def clock(self) -> PhaseClock:
        """A clock for one step, charging this record's phases."""
        return PhaseClock(self.phase_seconds)

    def record_model_run(self, num_used_blocks: int, model_seconds: float,
                         is_decode_only: bool) -> None:
        """A step's model ran on `num_used_blocks` device blocks."""
        self.peak_used_blocks = max(self.peak_used_blocks, num_used_blocks)
        if is_decode_only:
            self.decode_only_model_seconds += model_seconds
        self.num_steps += 1

    def record(self, num_preemptions: int, num_recomputed_tokens: int, num_generated_tokens: int,
               counters: SwapCounters, bytes_per_block: int,
               spec_decode: SpecDecodeStats) -> EngineStats:
        """This record with the scheduler's, the KV manager's and the speculator's counters,
        as `EngineStats` (`num_generated_tokens`: the tokens sequences kept, the scheduler's
        count: a verification samples rows it does not keep)."""
        return EngineStats(
            num_steps=self.num_steps,
            num_preemptions=num_preemptions,
            num_recomputed_tokens=num_recomputed_tokens,
            peak_used_blocks=self.peak_used_blocks,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generated_tokens=num_generated_tokens,
            phase_seconds=dict(self.phase_seconds),
            decode_only_model_seconds=self.decode_only_model_seconds,
            **swap_stats(counters, bytes_per_block),
            spec_decode=spec_decode,
        )


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

"""Scheduling options as the user gives them (vLLM's names): how many sequences and tokens
one step may take, chunked prefill, and what preemption does with a victim's KV. The engine
resolves them into the scheduler's own `kvpool.engine.scheduler.SchedulerConfig`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kvpool.engine.config.options import check_at_least_one, option, parse_json_object
from kvpool.engine.config.speculative import SpeculativeConfig

DEFAULT_CHUNKED_BATCHED_TOKENS = 1024
PREEMPTION_MODES = ("auto", "recompute", "swap")
SCHEDULING_POLICIES = ("fcfs", "priority")


@dataclass(frozen=True)
class SchedulingConfig:
    """`preemption_mode` says what a preempted sequence's KV becomes: "recompute" (dropped),
    "swap" (copied to the host tier, back on resumption), or "auto" (per victim, whichever the
    measured copy and prefill rates say is cheaper; recompute without a host tier).
    `max_num_batched_tokens` None: `batched_tokens_limit` picks it. `speculative_config` is
    given as vLLM's dict and kept as the checked `SpeculativeConfig` (None: no speculation).
    `scheduling_policy` (vLLM's name): "priority" serves lower `priority` values first, then
    earlier arrivals, and preempts the lowest priority first; "fcfs" serves by arrival and
    refuses a non-zero priority, as vLLM does. kvpool's default is "priority" (vLLM's is
    "fcfs"): with every priority 0 the two are the same order."""

    TITLE: ClassVar[str] = "scheduling"

    max_num_seqs: int = option(256)
    max_num_batched_tokens: int | None = option(None)
    enable_chunked_prefill: bool = option(True)
    preemption_mode: str = option(
        "auto", "what a preempted sequence's KV becomes: recompute (dropped), swap (to the "
        "host tier and back), auto (the cheaper of the two per victim, by measured copy and "
        "prefill rates)", choices=PREEMPTION_MODES)
    scheduling_policy: str = option(
        "priority", "priority: lower request priority first, then arrival (and the lowest "
        "priority preempted first); fcfs: arrival only, a non-zero priority is refused",
        choices=SCHEDULING_POLICIES)
    speculative_config: SpeculativeConfig | None = option(
        None, "speculative decoding, vLLM's JSON: e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}'",
        parser=parse_json_object, metavar="JSON")

    def __post_init__(self) -> None:
        object.__setattr__(self, "speculative_config",
                           SpeculativeConfig.from_value(self.speculative_config))
        check_at_least_one(max_num_seqs=self.max_num_seqs,
                           max_num_batched_tokens=self.max_num_batched_tokens)
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, "
                             f"got {self.preemption_mode!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")

    def batched_tokens_limit(self, max_model_len: int) -> int:
        """Tokens per step: a chunk size with chunked prefill, else room for a whole prompt."""
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    "without chunked prefill, max_num_batched_tokens "
                    f"({self.max_num_batched_tokens}) must be at least max_model_len "
                    f"({max_model_len})"
                )
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return DEFAULT_CHUNKED_BATCHED_TOKENS
        return max(max_model_len, DEFAULT_CHUNKED_BATCHED_TOKENS)

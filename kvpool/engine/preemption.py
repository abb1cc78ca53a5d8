"""What a preempted sequence's KV becomes: dropped and recomputed, or swapped to the host tier.

    preemption_mode   recompute   always drop the KV (the only mode without a host tier)
                      swap        copy it to the host tier (recompute if the host is full)
                      auto        per victim, the cheaper of the two:

        swap seconds      = bytes  / device→host bandwidth  +  bytes / host→device bandwidth
        recompute seconds = prefill FLOPs of its computed tokens / prefill FLOP rate

The three rates are measured at start-up, on this machine and this model
(`kvpool.engine.warmup.measure_transfer_rates`); `bytes` are the victim's blocks (codes and
scales). A prefix cache hit could make a recomputation cheaper than this estimate; the estimate
ignores it, which favours swapping, the choice that never recomputes a token.

Thrashing guard (the scheduler's, `recently_preempted`): a sequence preempted twice within the
last `HYSTERESIS_STEPS` steps is not chosen first as a victim again.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

HYSTERESIS_STEPS = 32  # the "short window" of the thrashing guard, in engine steps
RECOMPUTE, SWAP = "recompute", "swap"


@dataclass(frozen=True, slots=True)
class TransferRates:
    """Measured at start-up: copy bandwidths in bytes/s and the prefill rate in FLOP/s."""

    device_to_host_bytes_per_s: float
    host_to_device_bytes_per_s: float
    prefill_flops_per_s: float


class PreemptionPolicy:
    """Chooses "swap" or "recompute" for each victim (module docstring)."""

    def __init__(self, mode: str, bytes_per_block: int,
                 prefill_flops: Callable[[int], float]) -> None:
        """`prefill_flops(n)`: FLOPs of recomputing a sequence's first n tokens."""
        self.mode = mode
        self.bytes_per_block = bytes_per_block
        self.prefill_flops = prefill_flops
        self.rates: TransferRates | None = None  # set by the warm-up; None: not measured

    def swap_seconds(self, num_blocks: int) -> float:
        rates = self.rates
        num_bytes = num_blocks * self.bytes_per_block
        return (num_bytes / rates.device_to_host_bytes_per_s
                + num_bytes / rates.host_to_device_bytes_per_s)

    def recompute_seconds(self, num_computed_tokens: int) -> float:
        return self.prefill_flops(num_computed_tokens) / self.rates.prefill_flops_per_s

    def choose(self, num_blocks: int, num_computed_tokens: int) -> str:
        """"swap" or "recompute" for a victim holding `num_blocks` blocks of KV for its first
        `num_computed_tokens` tokens."""
        if self.mode != "auto":
            return self.mode
        if num_computed_tokens == 0:
            return RECOMPUTE  # nothing to keep
        if self.rates is None:
            return SWAP  # not measured: never recompute what could be kept
        swap = self.swap_seconds(num_blocks)
        return SWAP if swap < self.recompute_seconds(num_computed_tokens) else RECOMPUTE


def measure_copy_bandwidth(copy_blocks: Callable[[], int], repeats: int = 3) -> float:
    """Best bytes/s of `copy_blocks()` (which copies and returns the bytes it moved) over
    `repeats` timed calls after one untimed."""
    copy_blocks()
    best = float("inf")
    num_bytes = 0
    for _ in range(repeats):
        start = time.perf_counter()
        num_bytes = copy_blocks()
        _synchronize()
        best = min(best, time.perf_counter() - start)
    return num_bytes / max(best, 1e-9)


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()

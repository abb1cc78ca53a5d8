"""When drafting pays, from what the engine measures: each sequence's acceptance, and what a
step costs per token in the batch.

A step's wall time is modelled as `t(n) = a + b·n` for a batch of n tokens (a: reading the
weights and the fixed overheads; b: each token's compute), fitted by exponentially weighted
least squares over recent steps that computed no prompt (decodes and verifications: the
batches drafting changes). Drafting one more token for a sequence adds `b` seconds and, in
expectation, `α^j` tokens, where α is that sequence's acceptance rate and j the draft's
position (a draft counts only if every earlier one was accepted). The step's rate G / t (G:
tokens it yields) grows by adding a draft exactly when `α^j > b · G / t`, so
`choose_draft_lengths` adds drafts, best first, while that holds. One stream on a CPU is
bandwidth-bound (a ≫ b·n): almost any plausible draft pays. A large batch is compute-bound
(b·n ≫ a): only near-certain drafts do, and at low acceptance none.

Until the fit knows b (no spread in n yet) it takes b = 0: drafting is assumed free, and the
first drafted steps give the spread that measures it. A sequence's acceptance starts at the
prior `PRIOR_ACCEPTANCE` and follows its verifications; while it does not draft, its record
fades back towards the prior (`FADE`), so a sequence whose text turns repetitive later is
tried again.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.5
PRIOR_WEIGHT = 2.0  # the prior counts as this many draft tokens
FADE = 0.97  # per step without drafts: the record's weight decays towards the prior's
STEP_DECAY = 0.99  # per observed step: older steps weigh less in the cost fit


class StepCostModel:
    """`t(n) = a + b·n` by exponentially weighted least squares (weighted sums kept)."""

    def __init__(self) -> None:
        self._w = self._wn = self._wt = self._wnn = self._wnt = 0.0

    def observe(self, num_tokens: int, seconds: float) -> None:
        decay, n = STEP_DECAY, float(num_tokens)
        self._w = self._w * decay + 1.0
        self._wn = self._wn * decay + n
        self._wt = self._wt * decay + seconds
        self._wnn = self._wnn * decay + n * n
        self._wnt = self._wnt * decay + n * seconds

    @property
    def is_known(self) -> bool:
        return self._w > 0

    def coefficients(self) -> tuple[float, float]:
        """(a, b): seconds per step and per token; b = 0 (and a the mean) while the steps
        seen so far all had about the same size."""
        if not self._w:
            return 0.0, 0.0
        mean_n, mean_t = self._wn / self._w, self._wt / self._w
        spread = self._wnn / self._w - mean_n * mean_n
        if spread < 0.25:  # all steps (nearly) one size: no slope to read
            return mean_t, 0.0
        slope = max((self._wnt / self._w - mean_n * mean_t) / spread, 0.0)
        return max(mean_t - slope * mean_n, 0.0), slope


@dataclass(slots=True)
class Acceptance:
    """A sequence's draft record: accepted of tried draft tokens, the prior included."""

    accepted: float = PRIOR_ACCEPTANCE * PRIOR_WEIGHT
    tried: float = PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return self.accepted / self.tried

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """A verification: the first `num_accepted` of `num_drafts` drafts held. The drafts
        after the first rejection were never judged: the rate is per judged draft."""
        self.accepted += num_accepted
        self.tried += num_accepted + (num_accepted < num_drafts)

    def fade(self) -> None:
        """A step without drafts: the record drifts back towards the prior."""
        self.accepted = FADE * self.accepted + (1 - FADE) * PRIOR_ACCEPTANCE * PRIOR_WEIGHT
        self.tried = FADE * self.tried + (1 - FADE) * PRIOR_WEIGHT


def choose_draft_lengths(rates: list[float], max_lengths: list[int], num_tokens: int,
                         num_yielded: int, cost: tuple[float, float]) -> list[int]:
    """How many of its drafts each candidate keeps: drafts are added best first (`rate^j`
    for a candidate's j-th) while each raises the step's tokens per second.

    `num_tokens`: the batch's tokens before drafts; `num_yielded`: the tokens it yields
    (one per sampled sequence); `cost`: `StepCostModel.coefficients()`.
    """
    a, b = cost
    lengths = [0] * len(rates)
    seconds, gained = a + b * num_tokens, float(num_yielded)
    heap = [(-rate, index) for index, (rate, limit) in enumerate(zip(rates, max_lengths,
                                                                      strict=True))
            if limit > 0 and rate > 0]
    heapq.heapify(heap)
    while heap:
        negative_gain, index = heapq.heappop(heap)
        gain = -negative_gain
        if seconds > 0 and gain * seconds <= b * gained:
            break  # the best remaining draft would lower tokens per second; so would the rest
        lengths[index] += 1
        gained += gain
        seconds += b
        if lengths[index] < max_lengths[index]:
            heapq.heappush(heap, (-gain * rates[index], index))
    return lengths

"""Which replica a request goes to: pure choices over a snapshot of the healthy replicas.

`PrefixPolicy` (the default, `--policy prefix`) sends a request to the replica holding the
longest prefix of it, within a load cap:

    eligible = replicas whose load <= least load + max_load_imbalance
    chosen   = the eligible one with the most matched blocks; ties by least load, then in turn

so one hot prefix cannot pile more than `max_load_imbalance` requests onto its replica beyond
the least loaded one: past that, its requests spill to the next best. The reason is "prefix"
when the chosen replica holds at least one block of the prompt, else "load" (nothing matched
anywhere within the cap, or the prompt was not hashed). `is_load_capped` says that a replica
holding more blocks than the chosen one was passed over for its load.

`RoundRobinPolicy` (`--policy round-robin`) takes the replicas in turn, whatever they hold: the
baseline a benchmark compares with.

`LeastLoadPolicy` takes the replica with the fewest requests in flight, whatever it holds: how
a decode worker is chosen in disaggregated routing (its prompt is computed elsewhere).

Ties are broken by taking the tied replicas in turn (a counter per policy), so idle replicas
share cold requests rather than the first one taking them all. Policies are touched only from
the event loop, so the counters need no lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

POLICIES = ("prefix", "round-robin")
Reason = Literal["prefix", "load", "round_robin"]
REASONS: tuple[Reason, ...] = ("prefix", "load", "round_robin")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One healthy replica as a policy sees it."""

    name: str
    num_matched_blocks: int  # leading blocks of the prompt this replica holds
    num_in_flight: int  # requests the router has sent it that have not finished


@dataclass(frozen=True, slots=True)
class Choice:
    name: str
    reason: Reason
    num_matched_blocks: int
    is_load_capped: bool = False  # a replica with more matched blocks was too loaded


class Policy(Protocol):
    def choose(self, candidates: Sequence[Candidate]) -> Choice | None:
        """The replica to use among `candidates` (all healthy); None when there are none."""
        ...


class PrefixPolicy:
    def __init__(self, max_load_imbalance: int) -> None:
        if max_load_imbalance < 0:
            raise ValueError(f"max_load_imbalance must be >= 0, got {max_load_imbalance}")
        self.max_load_imbalance = max_load_imbalance
        self._num_ties = 0

    def choose(self, candidates: Sequence[Candidate]) -> Choice | None:
        if not candidates:
            return None
        least_load = min(candidate.num_in_flight for candidate in candidates)
        eligible = [candidate for candidate in candidates
                    if candidate.num_in_flight <= least_load + self.max_load_imbalance]
        num_best = max(candidate.num_matched_blocks for candidate in eligible)
        best = [candidate for candidate in eligible if candidate.num_matched_blocks == num_best]
        best_load = min(candidate.num_in_flight for candidate in best)
        tied = [candidate for candidate in best if candidate.num_in_flight == best_load]
        chosen = tied[self._num_ties % len(tied)]
        self._num_ties += len(tied) > 1
        is_capped = any(candidate.num_matched_blocks > num_best for candidate in candidates)
        reason: Reason = "prefix" if num_best > 0 else "load"
        return Choice(chosen.name, reason, num_best, is_capped)


class RoundRobinPolicy:
    def __init__(self) -> None:
        self._num_choices = 0

    def choose(self, candidates: Sequence[Candidate]) -> Choice | None:
        if not candidates:
            return None
        chosen = candidates[self._num_choices % len(candidates)]
        self._num_choices += 1
        return Choice(chosen.name, "round_robin", chosen.num_matched_blocks)


class LeastLoadPolicy:
    def __init__(self) -> None:
        self._num_ties = 0

    def choose(self, candidates: Sequence[Candidate]) -> Choice | None:
        if not candidates:
            return None
        least_load = min(candidate.num_in_flight for candidate in candidates)
        tied = [candidate for candidate in candidates if candidate.num_in_flight == least_load]
        chosen = tied[self._num_ties % len(tied)]
        self._num_ties += len(tied) > 1
        return Choice(chosen.name, "load", 0)


def make_policy(name: str, max_load_imbalance: int) -> Policy:
    if name == "prefix":
        return PrefixPolicy(max_load_imbalance)
    if name == "round-robin":
        return RoundRobinPolicy()
    raise ValueError(f"unknown routing policy {name!r}; choose from {POLICIES}")

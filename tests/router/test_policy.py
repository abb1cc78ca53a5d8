"""The routing policies as pure functions of (matched blocks, load) per healthy replica: the
longest prefix wins, ties go to the least loaded and then in turn, and the load cap spills a
hot prefix to the next best replica; round-robin ignores both, and least-load (how a decode
worker is chosen) ignores prefixes."""

from __future__ import annotations

import pytest

from kvpool.router.policy import (
    Candidate,
    Choice,
    LeastLoadPolicy,
    PrefixPolicy,
    RoundRobinPolicy,
    make_policy,
)


def candidates(*specs: tuple[int, int]) -> list[Candidate]:
    """(matched blocks, in flight) per replica, named r0, r1, ..."""
    return [Candidate(f"r{i}", matched, load) for i, (matched, load) in enumerate(specs)]


def test_the_longest_prefix_wins_over_a_lighter_load() -> None:
    choice = PrefixPolicy(4).choose(candidates((2, 1), (5, 3), (0, 0)))
    assert choice == Choice("r1", "prefix", 5)


def test_equal_prefixes_go_to_the_least_loaded() -> None:
    choice = PrefixPolicy(4).choose(candidates((3, 2), (3, 1), (0, 0)))
    assert choice == Choice("r1", "prefix", 3)


def test_full_ties_are_taken_in_turn() -> None:
    policy = PrefixPolicy(4)
    names = [policy.choose(candidates((0, 0), (0, 0), (0, 1))).name for _ in range(4)]
    assert names == ["r0", "r1", "r0", "r1"]
    assert policy.choose(candidates((0, 0), (0, 0))).reason == "load"


def test_no_match_anywhere_is_a_load_choice() -> None:
    assert PrefixPolicy(4).choose(candidates((0, 3), (0, 1))) == Choice("r1", "load", 0)


def test_the_cap_allows_exactly_max_load_imbalance_more() -> None:
    at_cap = PrefixPolicy(4).choose(candidates((6, 4), (0, 0)))
    assert at_cap == Choice("r0", "prefix", 6)
    past_cap = PrefixPolicy(4).choose(candidates((6, 5), (0, 0)))
    assert past_cap == Choice("r1", "load", 0, is_load_capped=True)


def test_past_the_cap_the_next_best_prefix_wins() -> None:
    choice = PrefixPolicy(2).choose(candidates((8, 9), (5, 3), (0, 1)))
    assert choice == Choice("r1", "prefix", 5, is_load_capped=True)


def test_a_hot_prefix_spreads_once_its_replica_is_loaded() -> None:
    """One prefix held only by r0, requests arriving and never finishing: r0 takes them up
    to the cap, then the others share the overflow and r0 again as they catch up."""
    policy = PrefixPolicy(2)
    loads = {"r0": 0, "r1": 0, "r2": 0}
    for _ in range(12):
        choice = policy.choose([Candidate(name, 4 if name == "r0" else 0, load)
                                for name, load in loads.items()])
        loads[choice.name] += 1
        assert max(loads.values()) - min(loads.values()) <= 3
    assert loads == {"r0": 6, "r1": 3, "r2": 3}


def test_zero_cap_is_pure_load_balancing_among_the_least_loaded() -> None:
    choice = PrefixPolicy(0).choose(candidates((9, 1), (2, 0), (0, 0)))
    assert choice == Choice("r1", "prefix", 2, is_load_capped=True)


def test_no_candidates_no_choice() -> None:
    assert PrefixPolicy(4).choose([]) is None
    assert RoundRobinPolicy().choose([]) is None


def test_round_robin_ignores_prefix_and_load() -> None:
    policy = RoundRobinPolicy()
    replicas = candidates((9, 0), (0, 7), (0, 0))
    choices = [policy.choose(replicas) for _ in range(4)]
    assert [choice.name for choice in choices] == ["r0", "r1", "r2", "r0"]
    assert {choice.reason for choice in choices} == {"round_robin"}


def test_make_policy_knows_both_names() -> None:
    assert isinstance(make_policy("prefix", 4), PrefixPolicy)
    assert isinstance(make_policy("round-robin", 4), RoundRobinPolicy)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 4)
    with pytest.raises(ValueError, match="max_load_imbalance"):
        PrefixPolicy(-1)


def test_least_load_ignores_prefixes_and_takes_ties_in_turn() -> None:
    policy = LeastLoadPolicy()
    assert policy.choose(candidates((9, 2), (0, 1), (5, 1))) == Choice("r1", "load", 0)
    assert policy.choose(candidates((9, 2), (0, 1), (5, 1))) == Choice("r2", "load", 0)
    assert policy.choose([]) is None

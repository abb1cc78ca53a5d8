"""Draft sizing: drafts are added only while they raise the step's tokens per second, by the
step cost measured (not assumed)."""

from __future__ import annotations

import pytest

from kvpool.engine.speculative.adaptive import (
    PRIOR_ACCEPTANCE,
    Acceptance,
    StepCostModel,
    choose_draft_lengths,
)


def test_the_cost_model_recovers_a_line_and_knows_when_it_cannot():
    model = StepCostModel()
    for _ in range(20):
        model.observe(1, 0.012)
    assert model.coefficients() == pytest.approx((0.012, 0.0))  # no spread: no slope yet
    for n in (1, 4, 8, 16, 32):
        model.observe(n, 0.010 + 0.002 * n)
    a, b = model.coefficients()
    assert b == pytest.approx(0.002, rel=0.05) and a == pytest.approx(0.010, rel=0.1)


def test_a_bandwidth_bound_step_drafts_everything_plausible():
    # One stream: 12 ms a step, 0.1 ms a token.
    lengths = choose_draft_lengths([0.9, 0.3], [5, 5], num_tokens=2, num_yielded=2,
                                   cost=(0.012, 0.0001))
    assert lengths[0] == 5 and lengths[1] >= 2


def test_a_compute_bound_batch_drafts_only_what_is_near_certain():
    # 32 sequences: 10 ms fixed, 2 ms per token: a draft must be surer than ~0.86.
    cost = (0.010, 0.002)
    assert choose_draft_lengths([0.5] * 32, [5] * 32, 32, 32, cost) == [0] * 32
    lengths = choose_draft_lengths([0.99] + [0.5] * 31, [5] * 32, 32, 32, cost)
    assert lengths[0] > 0 and lengths[1:] == [0] * 31


def test_unknown_cost_drafts_freely_so_that_it_gets_measured():
    assert choose_draft_lengths([0.2, 0.1], [3, 4], 2, 2, (0.0, 0.0)) == [3, 4]


def test_acceptance_learns_and_fades_back_to_the_prior():
    record = Acceptance()
    for _ in range(10):
        record.record(num_drafts=5, num_accepted=0)
    low = record.rate
    assert low < 0.1
    for _ in range(200):
        record.fade()
    assert record.rate == pytest.approx(PRIOR_ACCEPTANCE, abs=0.02)

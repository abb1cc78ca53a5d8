"""The sampler on hand-made logits: greedy, top-k/top-p/min-p, seeds, penalties, logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from kvpool.engine.sampler import Sampler, SamplingRow, apply_penalties, apply_top_k_top_p
from kvpool.engine.sampling_params import SamplingParams

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])


def row(generator=None, banned=(), prompt=(), output=(), **options) -> SamplingRow:
    return SamplingRow(SamplingParams(**options), list(prompt), list(output), generator, banned)


def test_greedy_takes_the_argmax_and_banned_tokens_are_skipped():
    sampler = Sampler()
    assert sampler(LOGITS, [row(temperature=0)]).token_ids == [1]
    assert sampler(LOGITS, [row(temperature=0, banned=(1,))]).token_ids == [2]


def test_top_k_one_and_tiny_top_p_are_greedy():
    sampler = Sampler(seed=0)
    for _ in range(20):
        assert sampler(LOGITS, [row(temperature=1.0, top_k=1)]).token_ids == [1]
        assert sampler(LOGITS, [row(temperature=1.0, top_p=0.01)]).token_ids == [1]


def test_top_k_top_p_mask_exactly_the_excluded_tokens():
    masked = apply_top_k_top_p(LOGITS.clone(), [row(top_k=3)])
    assert torch.isinf(masked[0]).tolist() == [False, False, False, True, True]
    probs = torch.softmax(LOGITS[0], -1)  # sorted: 1 (0.61), 2 (0.22), 0 (0.08) ...
    top_p = float(probs[1] + probs[2]) - 1e-4  # tokens 1 and 2 cover it; token 0 is not needed
    masked = apply_top_k_top_p(LOGITS.clone(), [row(top_p=top_p)])
    assert torch.isinf(masked[0]).tolist() == [True, False, False, True, True]


def test_min_p_keeps_only_tokens_near_the_top():
    sampler = Sampler(seed=1)
    seen = {sampler(LOGITS, [row(temperature=1.0, min_p=0.3)]).token_ids[0] for _ in range(200)}
    assert seen == {1, 2}  # p(2)/p(1) = e^-1 ≈ 0.37 >= 0.3; the rest are far below


def test_sampling_follows_the_distribution():
    sampler = Sampler(seed=2)
    counts = torch.zeros(5)
    rows = [row(temperature=1.0)] * 4000
    for token in sampler(LOGITS.repeat(4000, 1), rows).token_ids:
        counts[token] += 1
    torch.testing.assert_close(counts / 4000, torch.softmax(LOGITS[0], -1), atol=0.03, rtol=0)


def test_seeded_rows_repeat_whatever_the_rest_of_the_batch():
    def draw(batch_size: int) -> int:
        generator = torch.Generator().manual_seed(42)
        rows = [row(temperature=1.0)] * (batch_size - 1) + [row(generator, temperature=1.0)]
        for _ in range(3):  # advance the private stream, as a running sequence would
            tokens = Sampler(seed=batch_size)(LOGITS.repeat(batch_size, 1), rows).token_ids
        return tokens[-1]

    assert draw(1) == draw(7) == draw(3)


def test_penalties_follow_their_definitions():
    logits = torch.tensor([[2.0, -2.0, 1.0, 1.0]])
    penalised = apply_penalties(
        logits.clone(),
        [
            row(
                prompt=[0],
                output=[1, 2, 2],
                repetition_penalty=2.0,
                presence_penalty=0.5,
                frequency_penalty=0.25,
            )
        ],
    )
    # token 0: seen in the prompt -> 2.0 / 2; token 1: output once -> -2*2 - 0.5 - 0.25;
    # token 2: output twice -> 1/2 - 0.5 - 0.5; token 3: untouched
    assert penalised.tolist() == [[1.0, -4.75, -0.5, 1.0]]


def test_logprobs_report_the_sampled_token_and_top_alternatives():
    output = Sampler()(LOGITS, [row(temperature=0, logprobs=2)])
    entry = output.logprobs[0]
    expected = torch.log_softmax(LOGITS[0], -1)
    assert set(entry) == {1, 2}
    assert entry[1].rank == 1 and entry[2].rank == 2
    assert math.isclose(entry[1].logprob, float(expected[1]), rel_tol=1e-6)
    forced = Sampler()(LOGITS, [row(temperature=0, logprobs=1, banned=(1, 2))]).logprobs[0]
    assert forced[0].rank == 3 and set(forced) == {0, 1}


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_rows_are_independent_in_a_mixed_batch(temperature):
    rows = [row(temperature=0), row(temperature=temperature, top_k=1)]
    assert Sampler()(LOGITS.repeat(2, 1), rows).token_ids == [1, 1]

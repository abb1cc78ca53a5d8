"""The sampler on hand-made logits: greedy, top-k/top-p/min-p, seeds, penalties, logprobs,
non-finite logits, and (on the "meta" device) that its tensors follow the logits' device."""

from __future__ import annotations

import math
import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from kvpool.engine.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties,
    apply_top_k_top_p,
    choose_token_ids,
    raw_logprobs_of,
)
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


def test_bans_and_penalties_apply_to_their_own_row_and_leave_the_callers_logits_alone():
    rows = [
        row(temperature=0, banned=(1,)),
        row(temperature=0, banned=(1, 2)),
        row(temperature=0, output=[1], presence_penalty=2.0),  # 3 - 2 < 2: token 2 wins
        row(temperature=0),
    ]
    logits = LOGITS.repeat(len(rows), 1)
    assert Sampler()(logits, rows).token_ids == [2, 0, 2, 1]
    assert torch.equal(logits, LOGITS.repeat(len(rows), 1))


def test_shared_generator_draws_like_a_fresh_generator_seeded_the_same():
    logits = torch.randn(3, 200, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, dim=-1)
    sampler, reference = Sampler(seed=11), torch.Generator().manual_seed(11)
    for _ in range(5):
        race = torch.empty_like(probs).exponential_(generator=reference)
        expected = (probs / race).argmax(dim=-1).tolist()
        assert sampler(logits, [row(temperature=1.0)] * 3).token_ids == expected
    cpu = torch.device("cpu")
    assert sampler.generator(cpu) is sampler.generator(cpu) and sampler.generator(cpu).device == cpu


def reference_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The definitions, token by token in Python; ids past the vocabulary count nowhere."""
    result = logits.clone()
    vocab_size = logits.shape[1]
    for index, sampling_row in enumerate(rows):
        params = sampling_row.params
        counts = [0] * vocab_size
        for token_id in sampling_row.output_token_ids:
            if token_id < vocab_size:
                counts[token_id] += 1
        seen = set(sampling_row.prompt_token_ids) | {t for t in range(vocab_size) if counts[t]}
        for token_id in range(vocab_size):
            value = float(result[index, token_id])
            if token_id in seen and params.repetition_penalty != 1.0:
                penalty = params.repetition_penalty
                value = value / penalty if value > 0 else value * penalty
            value -= params.frequency_penalty * counts[token_id]
            value -= params.presence_penalty * (counts[token_id] > 0)
            result[index, token_id] = value
    return result


def test_vectorised_penalties_match_the_per_row_definition_on_a_random_batch():
    rng = random.Random(0)
    vocab_size = 40
    rows = []
    for _ in range(24):  # ids up to vocab_size + 2: those past the vocabulary must not spill
        rows.append(
            row(
                prompt=[rng.randrange(vocab_size + 3) for _ in range(rng.randrange(30))],
                output=[rng.randrange(vocab_size + 3) for _ in range(rng.randrange(30))],
                repetition_penalty=rng.choice([1.0, 1.0, 0.5, 1.3, 2.0]),
                presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
                frequency_penalty=rng.choice([0.0, 0.0, 0.25, -0.5]),
            )
        )
    assert any(not r.params.has_penalties for r in rows) and all(
        any(getattr(r.params, name) != default for r in rows)
        for name, default in [
            ("repetition_penalty", 1),
            ("presence_penalty", 0),
            ("frequency_penalty", 0),
        ]
    )
    logits = torch.randn(len(rows), vocab_size, generator=torch.Generator().manual_seed(1)) * 3
    penalised = apply_penalties(logits.clone(), rows)
    torch.testing.assert_close(penalised, reference_penalties(logits, rows), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("penalty", "prompt"), [(0.01, [2]), (100.0, [1])])
def test_repetition_penalty_at_its_bounds_gives_a_finite_sensible_token(penalty, prompt):
    # Logits in the tens of thousands; 0.01 lifts token 2 (2e4 -> 2e6), 100 sinks token 1
    # (3e4 -> 300): token 2 either way, for greedy, tiny and ordinary temperatures alike.
    temperatures = [0.0, 1e-40, 1e-5, 1.0]
    rows = [row(prompt=prompt, repetition_penalty=penalty, temperature=t) for t in temperatures]
    logits = LOGITS.repeat(len(rows), 1) * 1e4
    assert torch.isfinite(apply_penalties(logits.clone(), rows)).all()
    assert Sampler(seed=0)(logits, rows).token_ids == [2] * len(rows)


def test_a_tiny_temperature_is_greedy():
    rows = [row(temperature=1e-40), row(temperature=1e-6), row(temperature=1e-40, top_p=0.5)]
    assert Sampler(seed=0)(LOGITS.repeat(3, 1), rows).token_ids == [1, 1, 1]


def test_rows_with_nan_or_inf_logits_take_the_argmax_of_their_finite_logits():
    logits = LOGITS.repeat(5, 1)
    logits[0, 0] = logits[1, 0] = float("nan")  # argmax would take NaN for the maximum
    logits[2, 4] = float("inf")  # softmax of +inf is NaN
    logits[3] = float("nan")
    logits[3, 3] = 0.0  # a single finite logit
    rows = [
        row(temperature=0),
        row(temperature=1.0),
        row(temperature=0.8, top_k=3, top_p=0.9),
        row(temperature=1.0, min_p=0.1),
        row(temperature=1.0, top_k=1),  # a healthy row beside them is untouched
    ]
    assert Sampler(seed=0)(logits, rows).token_ids == [1, 1, 1, 3, 1]


class DeviceRecorder(TorchDispatchMode):
    """Records every op that meets or makes a tensor off `device` (a CPU tensor, say)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.strays: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._check(func, "argument", (args, kwargs))  # before: a mixed op may raise
        result = func(*args, **(kwargs or {}))
        self._check(func, "result", result)
        return result

    def _check(self, func, role: str, tree) -> None:
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor) and leaf.device != self.device:
                self.strays.append(f"{func}: {role} on {leaf.device}")


DEVICE_ROWS = [  # every path: greedy, bans, logprobs, all three penalties, top-k/top-p, min-p
    row(temperature=0, banned=(3, 5), logprobs=2),
    row(
        temperature=0,
        prompt=[1, 2, 2],
        output=[4, 4, 70],
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.2,
    ),
    row(temperature=0.7, top_k=5, top_p=0.9, output=[9]),
    row(temperature=1e-40, min_p=0.1, prompt=[7], repetition_penalty=0.8, banned=(0,)),
    row(temperature=1.2, min_p=0.05, output=[1, 1], frequency_penalty=-0.5, logprobs=0),
    row(temperature=1.0),
]


def test_every_tensor_the_sampler_makes_follows_the_logits_device():
    # "meta" stands for any device that is not the CPU: a CPU tensor meeting these logits
    # raises, the recorder lists any op that makes or touches one, and meta tensors hold no
    # data, so a host sync (.item(), bool(), .tolist(), nonzero, a boolean mask) raises too.
    # (A FakeTensorMode "cuda" does not work on a CPU-only build: Python indexing asks for
    # the CUDA runtime, and fake tensors refuse an explicit generator.)
    device = torch.device("meta")
    logits = torch.empty(len(DEVICE_ROWS), 64, device=device)
    recorder = DeviceRecorder(device)
    with torch.inference_mode(), recorder:
        token_ids = choose_token_ids(logits.to(torch.bfloat16), DEVICE_ROWS, generator=None)
        logprobs = raw_logprobs_of(logits, [0, 4])
    assert recorder.strays == []
    assert token_ids.device == device and token_ids.shape == (len(DEVICE_ROWS),)
    assert logprobs.device == device and logprobs.shape == (2, 64)


def test_a_row_generator_on_another_device_than_the_logits_is_refused():
    logits = torch.empty(2, 64, device="meta")
    rows = [row(temperature=0), row(torch.Generator().manual_seed(0), temperature=1.0)]
    with pytest.raises(AssertionError, match="model's device"):
        choose_token_ids(logits, rows, generator=None)

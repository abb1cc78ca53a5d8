"""The sampler on hand-made logits: greedy, top-k/top-p/min-p, seeds, penalties, logprobs,
non-finite logits, grammar bitmasks, logit bias, allowed token ids, bad words, and (on the
"meta" device) that its tensors follow the logits' device; then the last four on the engine."""

from __future__ import annotations

import dataclasses
import math
import random

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import kvpool.engine.sampling.sampler as sampler_module
from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling.constraints import (
    apply_allowed_token_ids,
    apply_logit_bias,
    bitmask_penalty,
)
from kvpool.engine.sampling.rows import SamplingRow
from kvpool.engine.sampling.sampler import (
    Sampler,
    apply_penalties,
    apply_top_k_top_p,
    choose_token_ids,
    raw_logprobs_of,
)
from kvpool.engine.sampling.token_rules import TokenRules
from kvpool.engine.sampling_params import SamplingParams
from tests.engine.conftest import run_all

LOGITS = torch.tensor([[1.0, 3.0, 2.0, 0.5, -1.0]])


def row(generator=None, banned=(), prompt=(), output=(), device="cpu", bad_words=(),
        **options) -> SamplingRow:
    """A row whose token rules are built as intake builds them (bad words as token ids)."""
    params = SamplingParams(**options)
    rules = TokenRules.from_token_ids(params.logit_bias, params.allowed_token_ids,
                                      [tuple(word) for word in bad_words], torch.device(device))
    return SamplingRow(params, list(prompt), list(output), generator, banned, rules=rules)


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


def reference_top_k_top_p(row_logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """The definition, one row, in float64: the best top_k tokens, then the fewest of them,
    best first, whose renormalised probability reaches top_p."""
    order = row_logits.double().argsort(descending=True)[: top_k or len(row_logits)]
    probs = torch.softmax(row_logits.double()[order], dim=-1).tolist()
    kept, mass = [], 0.0
    for token_id, prob in zip(order.tolist(), probs, strict=True):
        if kept and mass >= top_p:
            break
        kept.append(token_id)
        mass += prob
    result = torch.full_like(row_logits, float("-inf"))
    result[kept] = row_logits[kept]
    return result


@pytest.mark.parametrize("scale", [0.3, 3.0, 12.0])  # flat rows need the full sort, peaky don't
def test_candidate_ranking_masks_exactly_what_a_full_sort_does(monkeypatch, scale):
    monkeypatch.setattr(sampler_module, "_CANDIDATES", 64)
    settings = [(0, 0.5), (0, 0.9), (0, 1.0), (10, 1.0), (10, 0.8), (100, 0.95), (0, 0.99)]
    logits = torch.randn(len(settings), 3000, generator=torch.Generator().manual_seed(7)) * scale
    rows = [row(top_k=top_k, top_p=top_p) for top_k, top_p in settings]
    masked = apply_top_k_top_p(logits.clone(), rows)
    for index, (top_k, top_p) in enumerate(settings):
        expected = reference_top_k_top_p(logits[index], top_k, top_p)
        assert torch.equal(masked[index].isinf(), expected.isinf()), (top_k, top_p)


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


def test_sampling_never_draws_a_token_without_probability():
    # Token 0 (first in the cumulative sum) and the last token have no mass: the inverse-CDF
    # draw must skip them even for extreme uniforms.
    rows = [row(temperature=1.0, banned=(0, 4), top_k=3)] * 4000
    token_ids = Sampler(seed=5)(LOGITS.repeat(4000, 1), rows).token_ids
    assert set(token_ids) <= {1, 2, 3} and len(set(token_ids)) > 1


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
        targets = torch.rand(3, 1, generator=reference) * probs.sum(dim=-1, keepdim=True)
        expected = torch.searchsorted(probs.cumsum(dim=-1), targets, right=True)[:, 0].tolist()
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


# ------------------------------------------- grammar masks, logit bias, allowed ids, bad words
class AllowOnly:
    """A stand-in grammar matcher that allows only `token_ids` (the `TokenMask` protocol),
    recording the tokens it is advanced by."""

    is_terminated = False

    def __init__(self, *token_ids: int) -> None:
        self.token_ids = token_ids
        self.accepted: list[int] = []

    @property
    def num_accepted(self) -> int:
        return len(self.accepted)

    def rewind_to(self, num_tokens: int) -> None:
        del self.accepted[num_tokens:]

    def accept(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return token_id in self.token_ids

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        words = bitmask.numpy()[row]  # host memory, written outside torch, like xgrammar
        words[:] = 0
        for token_id in self.token_ids:
            words[token_id // 32] |= np.int32(np.uint32(1 << (token_id % 32)).view(np.int32))
        return True


def constrained(matcher=None, **options) -> SamplingRow:
    return dataclasses.replace(row(**options), matcher=matcher)


@pytest.mark.parametrize("vocab_size", [5, 32, 70])
def test_bitmask_penalty_is_zero_exactly_where_a_bit_is_set(vocab_size):
    num_words = -(-vocab_size // 32)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, num_words), dtype=torch.int32,
                            generator=torch.Generator().manual_seed(vocab_size))
    expected = torch.tensor([[bool(int(bitmask[r, t // 32]) >> (t % 32) & 1)
                              for t in range(vocab_size)] for r in range(3)])
    penalty = bitmask_penalty(bitmask, vocab_size)
    assert penalty.shape == (3, vocab_size) and penalty.dtype == torch.float32
    assert torch.equal(penalty == 0, expected)
    assert torch.isneginf(penalty[~expected]).all()


def test_a_grammar_mask_limits_its_row_only_and_leaves_the_logprobs_raw():
    rows = [constrained(AllowOnly(3, 4), temperature=0, logprobs=0),
            row(temperature=0),
            constrained(AllowOnly(0), temperature=1.0)]
    logits = LOGITS.repeat(3, 1)
    output = Sampler(seed=0)(logits, rows)
    assert output.token_ids == [3, 1, 0]  # 3: the best of the allowed
    expected = float(torch.log_softmax(LOGITS[0], -1)[3])
    assert math.isclose(output.logprobs[0][3].logprob, expected, rel_tol=1e-6)
    assert torch.equal(logits, LOGITS.repeat(3, 1))
    draws = Sampler(seed=1)(LOGITS.repeat(200, 1), [constrained(AllowOnly(0, 4),
                                                                temperature=1.0)] * 200)
    assert set(draws.token_ids) == {0, 4}


def test_the_sampler_advances_each_grammar_by_its_rows_token_after_a_rewind():
    matchers = [AllowOnly(3, 4), AllowOnly(0)]
    matchers[0].accepted = [9, 9]  # a rolled-back step left it a token ahead of its output
    rows = [constrained(matchers[0], temperature=0, output=[9]),
            row(temperature=0),
            constrained(matchers[1], temperature=0)]
    assert Sampler()(LOGITS.repeat(3, 1), rows).token_ids == [3, 1, 0]
    assert matchers[0].accepted == [9, 3] and matchers[1].accepted == [0]


def test_every_token_masked_gives_some_token_rather_than_an_error():
    rows = [constrained(AllowOnly(), temperature=0), constrained(AllowOnly(), temperature=1.0)]
    token_ids = Sampler()(LOGITS.repeat(2, 1), rows).token_ids
    assert all(0 <= token_id < LOGITS.shape[1] for token_id in token_ids)


def test_logit_bias_is_added_before_the_penalties():
    # Token 0 (logit 1) was generated; repetition penalty 2 and a bias of 3. Bias first:
    # (1 + 3) / 2 = 2 < 3, token 1 stays the argmax; penalty first would give 0.5 + 3 = 3.5.
    rows = [row(temperature=0, output=[0], repetition_penalty=2.0, logit_bias={0: 3.0}),
            row(temperature=0, logit_bias={4: 4.5}), row(temperature=0, logit_bias={1: -100})]
    assert Sampler()(LOGITS.repeat(3, 1), rows).token_ids == [1, 4, 2]
    biased = LOGITS.repeat(3, 1)
    apply_logit_bias(biased, rows)
    assert biased[1].tolist() == [1.0, 3.0, 2.0, 0.5, 3.5]


def test_allowed_token_ids_limit_their_row():
    rows = [row(temperature=0, allowed_token_ids=[0, 3]), row(temperature=0),
            row(temperature=1.0, allowed_token_ids=[4])]
    assert Sampler(seed=0)(LOGITS.repeat(3, 1), rows).token_ids == [0, 1, 4]
    limited = LOGITS.repeat(3, 1)
    apply_allowed_token_ids(limited, rows)
    assert torch.isinf(limited[0]).tolist() == [False, True, True, False, True]
    assert torch.equal(limited[1], LOGITS[0])


def test_bad_words_ban_single_tokens_always_and_last_tokens_after_their_prefix():
    words = [(1,), (3, 2), (0, 3, 4)]
    rules = row(bad_words=words).rules
    assert rules.banned_token_ids.tolist() == [1]
    assert rules.bad_word_bans([]) == []
    assert rules.bad_word_bans([4, 3]) == [2]
    assert rules.bad_word_bans([0, 3]) == [2, 4]
    rows = [constrained(bad_words=words, temperature=0, output=[3]),  # 1 and 2 banned
            constrained(bad_words=words, temperature=0, output=[2])]  # only 1
    assert Sampler()(LOGITS.repeat(2, 1), rows).token_ids == [0, 2]


class HostTensorRecorder(DeviceRecorder):
    """Records the dtype and shape of every tensor off `device` that an op meets or makes."""

    def _check(self, func, role: str, tree) -> None:
        for leaf in tree_leaves(tree):
            if isinstance(leaf, torch.Tensor) and leaf.device != self.device:
                self.strays.append((leaf.dtype, tuple(leaf.shape)))


def test_the_grammar_path_follows_the_logits_device_but_for_its_host_bitmask():
    # xgrammar fills the bitmask in host memory: it is the only tensor off the logits' device
    # (made, filled, copied over); everything after the copy is on the device.
    device = torch.device("meta")
    rows = [constrained(AllowOnly(1), temperature=0, logit_bias={2: 1.0}, bad_words=[(5,)],
                        device=device),
            row(temperature=1.0, allowed_token_ids=[3, 7], device=device),
            constrained(AllowOnly(9, 10), temperature=0.7, top_k=3, device=device)]
    logits = torch.empty(len(rows), 64, device=device)
    recorder = HostTensorRecorder(device)
    with torch.inference_mode(), recorder:
        token_ids = choose_token_ids(logits, rows, generator=None)
    assert recorder.strays and all(dtype == torch.int32 and shape[-1:] == (2,)
                                   for dtype, shape in recorder.strays), recorder.strays
    assert token_ids.device == device and token_ids.shape == (len(rows),)


# ------------------------------------------------------------------ on the real engine
SMALL_ENGINE = {"dtype": "float32", "kv_cache_memory": 16 * 2**20, "max_model_len": 512}


@pytest.mark.slow
def test_engine_logit_bias_forces_a_token(make_engine):
    engine = make_engine(**SMALL_ENGINE)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                            logit_bias={1234: 100.0})
    assert engine.add_request("Hello", params) is not None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                assert output.outputs[0].token_ids == [1234] * 4


@pytest.mark.slow
def test_engine_allowed_token_ids_and_bad_words(make_engine, smollm2):
    engine = make_engine(**SMALL_ENGINE)
    prompt = "The capital of France is"
    free, allowed, banned = run_all(engine, [prompt] * 3, [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True,
                       allowed_token_ids=[11, 22, 33]),
        SamplingParams(temperature=0, max_tokens=6, bad_words=["Paris"]),
    ])
    assert "Paris" in free.outputs[0].text  # what the ban has to change
    assert set(allowed.outputs[0].token_ids) <= {11, 22, 33}
    assert "Paris" not in banned.outputs[0].text
    encode = smollm2.tokenizer.encode
    request = engine.add_request(prompt, SamplingParams(bad_words=["  Paris", "Paris"]))
    expected = {tuple(encode("Paris", False)), tuple(encode(" Paris", False))}
    assert set(request.token_rules.bad_words_token_ids) == expected  # stripped, both forms, once
    engine.abort_request(request.request_id)


@pytest.mark.slow
@pytest.mark.parametrize("param", ["logit_bias", "allowed_token_ids"])
def test_engine_refuses_token_ids_past_the_vocabulary(make_engine, param):
    engine = make_engine(**SMALL_ENGINE)
    vocab_size = engine.model_config.vocab_size
    value = {vocab_size: 1.0} if param == "logit_bias" else [0, vocab_size]
    with pytest.raises(InvalidRequestError) as raised:
        engine.add_request([1, 2], SamplingParams(**{param: value}))
    assert raised.value.param == param

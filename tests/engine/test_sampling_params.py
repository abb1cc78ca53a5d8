"""SamplingParams rejects every out-of-range value with a typed error that names the field and
its range, never the value; output kinds; what counts as greedy."""

from __future__ import annotations

import pytest

from kvpool.engine.errors import InvalidRequestError
from kvpool.engine.sampling_params import RequestOutputKind, SamplingParams


@pytest.mark.parametrize(
    ("options", "param", "message"),
    [
        ({"n": 0}, "n", "n must be at least 1"),
        ({"temperature": -0.1}, "temperature", "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature", "temperature must be >= 0"),
        ({"temperature": float("inf")}, "temperature", "temperature must be finite"),
        ({"temperature": 2.01}, "temperature", r"temperature must be in \[0, 2\]"),
        ({"temperature": 1e308}, "temperature", r"temperature must be in \[0, 2\]"),
        ({"logit_bias": dict.fromkeys(range(301), 1.0)}, "logit_bias", "at most 300 entries"),
        ({"allowed_token_ids": list(range(8193))}, "allowed_token_ids", "at most 8192"),
        ({"bad_words": ["w"] * 129}, "bad_words", "at most 128 entries"),
        ({"top_p": 0.0}, "top_p", r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, "top_p", r"top_p must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k", "top_k"),
        ({"min_p": 1.5}, "min_p", r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", r"must be in \[0.01, 100\]"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty", r"must be in \[0.01, 100\]"),
        ({"repetition_penalty": 1e300}, "repetition_penalty", r"must be in \[0.01, 100\]"),
        ({"presence_penalty": 2.5}, "presence_penalty", r"presence_penalty must be in \[-2, 2\]"),
        ({"frequency_penalty": -3}, "frequency_penalty", r"frequency_penalty must be in \[-2, 2\]"),
        ({"max_tokens": 0}, "max_tokens", "max_tokens"),
        ({"min_tokens": -1}, "min_tokens", "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens", "must not exceed max_tokens"),
        ({"logprobs": -1}, "logprobs", "logprobs"),
        ({"stop": [""]}, "stop", "stop strings"),
        ({"stop_token_ids": [-4]}, "stop_token_ids", "stop_token_ids"),
        ({"output_kind": "delta"}, "output_kind", "output_kind must be a RequestOutputKind"),
    ],
)
def test_invalid_values_raise_invalid_request_error_naming_the_field(options, param, message):
    with pytest.raises(InvalidRequestError, match=message) as caught:
        SamplingParams(**options)
    assert caught.value.param == param
    assert isinstance(caught.value, ValueError)  # offline callers catching ValueError still do


@pytest.mark.parametrize(
    "options",
    [
        {"n": -987},
        {"temperature": -4.5678},
        {"top_p": 9.8765},
        {"top_k": -4321},
        {"min_p": 7.6543},
        {"repetition_penalty": 123.456},
        {"presence_penalty": -3.14159},
        {"frequency_penalty": 2.71828},
        {"max_tokens": -555},
        {"min_tokens": -777},
        {"min_tokens": 999, "max_tokens": 333},
        {"logprobs": -888},
        {"stop_token_ids": [-31337]},
    ],
)
def test_messages_never_echo_the_value(options):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**options)
    for value in options.values():
        shown = str(value[0]) if isinstance(value, list) else str(value)
        assert shown not in str(caught.value)


def test_normalisation():
    params = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert params.stop == ["###"] and params.top_k == 0 and params.is_greedy
    assert not params.has_penalties and SamplingParams(presence_penalty=0.5).has_penalties


def test_the_caps_themselves_are_accepted():
    SamplingParams(temperature=2.0, logit_bias=dict.fromkeys(range(300), 1.0),
                   allowed_token_ids=list(range(8192)), bad_words=["w"] * 128)


def test_temperatures_below_the_sampling_epsilon_are_greedy():
    assert SamplingParams(temperature=1e-40).is_greedy
    assert SamplingParams(temperature=9.9e-6).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy


def test_repetition_penalty_bounds_are_inclusive():
    assert SamplingParams(repetition_penalty=0.01).has_penalties
    assert SamplingParams(repetition_penalty=100).has_penalties


def test_output_kind_defaults_to_cumulative_and_takes_every_kind():
    assert SamplingParams().output_kind is RequestOutputKind.CUMULATIVE
    assert [kind.name for kind in RequestOutputKind] == ["CUMULATIVE", "DELTA", "FINAL_ONLY"]
    for kind in RequestOutputKind:
        assert SamplingParams(output_kind=kind).output_kind is kind

"""SamplingParams rejects every out-of-range value with a message naming it."""

from __future__ import annotations

import pytest

from kvpool.engine.sampling_params import SamplingParams


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"n": 0}, "n must be at least 1"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"top_p": 0.0}, "top_p must be in"),
        ({"top_p": 1.5}, "top_p must be in"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "must not exceed max_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"stop": [""]}, "stop strings"),
        ({"stop_token_ids": [-4]}, "stop_token_ids"),
    ],
)
def test_invalid_values_raise_value_error(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_normalisation():
    params = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert params.stop == ["###"] and params.top_k == 0 and params.is_greedy
    assert not params.has_penalties and SamplingParams(presence_penalty=0.5).has_penalties

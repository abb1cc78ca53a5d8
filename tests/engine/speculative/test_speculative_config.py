"""`speculative_config`: vLLM's names and defaults, a clear error naming what is wrong, and the
same JSON on every command's `--speculative-config`."""

from __future__ import annotations

import argparse

import pytest

from kvpool import LLM
from kvpool.cli.args import add_engine_args, engine_config_from_args
from kvpool.engine.config import EngineConfig
from kvpool.engine.config.speculative import SpeculativeConfig


def speculative(**given):
    return EngineConfig(speculative_config=given).scheduling.speculative_config


def test_vllm_defaults_for_the_lookup_bounds():
    assert speculative(method="ngram", num_speculative_tokens=3) == SpeculativeConfig(
        "ngram", 3, prompt_lookup_max=5, prompt_lookup_min=5)
    only_max = speculative(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4)
    assert (only_max.prompt_lookup_min, only_max.prompt_lookup_max) == (4, 4)
    assert speculative(model="[ngram]", num_speculative_tokens=2).method == "ngram"
    assert EngineConfig().scheduling.speculative_config is None


def test_suffix_takes_vllms_fields_and_defaults():
    config = speculative(method="suffix")
    assert config.num_speculative_tokens == config.suffix_decoding_max_tree_depth == 24
    assert (config.suffix_decoding_max_cached_requests, config.suffix_decoding_max_spec_factor,
            config.suffix_decoding_min_token_prob) == (10000, 1.0, 0.1)
    assert SpeculativeConfig.from_dict(config.as_dict()) == config
    assert "suffix_decoding_max_tree_depth" not in speculative(
        method="ngram", num_speculative_tokens=3).as_dict()


@pytest.mark.parametrize(("given", "message"), [
    ({"method": "ngram"}, "needs num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"metod": "ngram"}, "did you mean 'method'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2}, "must not exceed"),
    ({"model": "some/draft", "num_speculative_tokens": 2}, "'draft_model'"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "probability in"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "positive number"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 1}, "at least 2"),
    ({"method": "beam", "num_speculative_tokens": 2}, "must be one of"),
])
def test_bad_settings_are_refused_by_name(given, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=given)


def test_llm_takes_it_as_vllm_does():
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        LLM(speculative_config={"method": "ngram"})


def test_every_command_takes_the_json_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--speculative-config",
                              '{"method": "ngram", "num_speculative_tokens": 4}'])
    config = engine_config_from_args(args).scheduling.speculative_config
    assert config.num_speculative_tokens == 4
    with pytest.raises(SystemExit):
        parser.parse_args(["--speculative-config", "not json"])

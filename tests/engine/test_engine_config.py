"""`EngineConfig`'s sections: one owner per option, flat vLLM names routed to it, checks that
span sections, and flags generated from the fields (one flag each, the field's default)."""

from __future__ import annotations

import argparse
import dataclasses
import pickle

import pytest

from kvpool.cli.args import add_engine_args, engine_config_from_args, engine_flag_arguments
from kvpool.engine.config import (
    OPTION_SECTIONS,
    SECTIONS,
    CacheConfig,
    EngineConfig,
    SchedulingConfig,
    TierConfig,
)
from kvpool.engine.config.options import flag_name, flag_of
from kvpool.engine.vllm_compat import RENAMED


def _engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser


def test_every_option_has_exactly_one_flag_with_the_fields_default():
    parser = _engine_parser()
    by_dest: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        by_dest.setdefault(action.dest, []).append(action)
    for name, section in OPTION_SECTIONS.items():
        (action,) = by_dest[name]  # exactly one flag per field
        config_field = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]
        spellings = {flag_name(name), *flag_of(config_field).aliases}
        if isinstance(config_field.default, bool):  # --x and --no-x
            spellings.add("--no-" + flag_name(name).removeprefix("--"))
        assert set(action.option_strings) == spellings, name
        assert action.default == config_field.default, name
        assert action.choices == flag_of(config_field).choices, name


def test_parsing_no_flags_builds_the_default_config():
    assert engine_config_from_args(_engine_parser().parse_args([])) == EngineConfig()


def test_the_positional_model_is_the_model_field():
    (names, kwargs), *_ = engine_flag_arguments(SECTIONS["load"], model_positional=True)
    assert names == ("model",) and kwargs["nargs"] == "?" and kwargs["default"] is None


def test_option_names_belong_to_exactly_one_section():
    declared = [f.name for cls in SECTIONS.values() for f in dataclasses.fields(cls)]
    assert len(declared) == len(set(declared)) == len(OPTION_SECTIONS)
    assert not set(OPTION_SECTIONS) & set(SECTIONS)


def test_flat_names_route_to_their_sections():
    config = EngineConfig(block_size=8, swap_space=1, preemption_mode="swap", seed=3)
    assert config.cache == CacheConfig(block_size=8)
    assert config.tiers == TierConfig(swap_space=1)
    assert config.scheduling == SchedulingConfig(preemption_mode="swap")
    assert config.load.seed == 3


def test_flat_names_go_over_a_section_given_whole():
    config = EngineConfig(cache=CacheConfig(block_size=8, watermark=0.1), block_size=32)
    assert (config.cache.block_size, config.cache.watermark) == (32, 0.1)


def test_replace_takes_flat_names_and_keeps_the_rest():
    config = EngineConfig(block_size=8, dtype="bf16")
    changed = dataclasses.replace(config, kv_cache_dtype="int8")
    assert (changed.cache.block_size, changed.cache.kv_cache_dtype) == (8, "int8")
    assert changed.load == config.load


def test_an_unknown_option_is_named_with_the_closest_known_one():
    with pytest.raises(TypeError, match="unknown option 'blok_size'; did you mean 'block_size'"):
        EngineConfig(blok_size=8)
    with pytest.raises(TypeError, match="cache must be a CacheConfig"):
        EngineConfig(cache=TierConfig())


def test_sections_check_their_own_options():
    with pytest.raises(ValueError, match="block_size must be at least 1"):
        CacheConfig(block_size=0)
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        SchedulingConfig(preemption_mode="never")
    with pytest.raises(ValueError, match="swap_space must be >= 0"):
        EngineConfig(swap_space=-1)
    # A size string is the command line's to parse: the config says so, not a TypeError.
    with pytest.raises(ValueError, match="kv_cache_memory must be an integer, got '64MiB'"):
        EngineConfig(kv_cache_memory="64MiB")


@pytest.mark.parametrize(("options", "message"), [
    ({"preemption_mode": "swap"}, "needs a host tier"),
    ({"kv_disk_cache": "/tmp", "enable_prefix_caching": False}, "kv_disk_cache keeps prefix"),
    ({"kv_shared_redis": "redis://h:1/0", "enable_prefix_caching": False}, "kv_shared_redis"),
    ({"tensor_parallel_size": 2, "swap_space": 1}, "does not support swap_space"),
    ({"tensor_parallel_size": 2, "kv_pool": "elastic"}, "does not support kv_pool='elastic'"),
])
def test_checks_across_sections(options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**options)


def test_vllm_renames_are_the_flags_long_aliases():
    assert RENAMED == {"num_gpu_blocks_override": "num_gpu_blocks",
                       "kv_cache_memory_bytes": "kv_cache_memory",
                       "cuda_graph_sizes": "cudagraph_capture_sizes"}


@pytest.mark.parametrize("sizes", [[], [0, 4]])
def test_cudagraph_capture_sizes_must_be_batch_sizes(sizes):
    with pytest.raises(ValueError, match="cudagraph_capture_sizes must be batch sizes"):
        EngineConfig(cudagraph_capture_sizes=sizes)


def test_cudagraph_capture_sizes_are_kept_sorted_and_distinct():
    assert EngineConfig(cudagraph_capture_sizes=[8, 1, 4, 4]).load.cudagraph_capture_sizes == (
        1, 4, 8)


def test_a_config_pickles_for_the_tensor_parallel_workers():
    config = EngineConfig(block_size=8, override_generation_config={"temperature": 0.5})
    assert pickle.loads(pickle.dumps(config)) == config

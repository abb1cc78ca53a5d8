"""The shared engine and sampling flags reach `EngineConfig` and `SamplingParams`; sizes parse;
vLLM's flags kvpool has no counterpart for are accepted at neutral values, refused otherwise."""

from __future__ import annotations

import argparse
import logging

import pytest

from kvpool.cli.args import (
    add_engine_args,
    add_sampling_args,
    engine_config_from_args,
    parse_size,
    sampling_params_from_args,
)


def test_kv_pool_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-pool", "elastic", "--kv-pool-initial-blocks", "0",
                              "--kv-pool-segment-blocks", "32", "--kv-pool-idle-seconds", "2.5",
                              "--no-enable-warmup"])
    config = engine_config_from_args(args)
    cache = config.cache
    assert (cache.kv_pool, cache.kv_pool_initial_blocks, cache.kv_pool_segment_blocks,
            cache.kv_pool_idle_seconds, config.load.enable_warmup) == ("elastic", 0, 32, 2.5, False)
    assert engine_config_from_args(parser.parse_args([])).cache.kv_pool == "static"


def test_kv_tier_flags_reach_the_config(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--swap-space", "1.5", "--preemption-mode", "swap",
                              "--kv-disk-cache", str(tmp_path), "--kv-disk-cache-size", "2GiB"])
    config = engine_config_from_args(args)
    assert (config.tiers.swap_space, config.scheduling.preemption_mode) == (1.5, "swap")
    assert (config.tiers.kv_disk_cache, config.tiers.kv_disk_cache_size) == (str(tmp_path), 2 << 30)
    defaults = engine_config_from_args(parser.parse_args([]))
    assert (defaults.tiers.swap_space, defaults.scheduling.preemption_mode,
            defaults.tiers.kv_disk_cache) == (
        0.0, "auto", None)


def test_engine_flags_have_vllm_names_and_the_model_can_be_positional():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_positional=True)
    args = parser.parse_args(["m.gguf", "--kv-cache-memory", "512MiB", "--max-num-seqs", "8",
                              "--no-enable-prefix-caching", "--block-size", "32"])
    config = engine_config_from_args(args)
    assert (config.load.model, config.cache.kv_cache_memory,
            config.scheduling.max_num_seqs) == ("m.gguf", 512 << 20, 8)
    assert (config.cache.enable_prefix_caching, config.cache.block_size) == (False, 32)


def test_kv_cache_dtype_flag_takes_vllms_names_and_refuses_others(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    for name in ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2"):
        assert engine_config_from_args(
            parser.parse_args(["--kv-cache-dtype", name])).cache.kv_cache_dtype == name
    assert engine_config_from_args(parser.parse_args([])).cache.kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "int4"])
    assert "invalid choice: 'int4'" in capsys.readouterr().err


def test_sampling_flags_reach_the_params():
    parser = argparse.ArgumentParser()
    add_sampling_args(parser)
    args = parser.parse_args(["--max-tokens", "5", "--temperature", "0.5", "-n", "2",
                              "--stop", "a", "--stop", "b", "--sampling-seed", "7"])
    params = sampling_params_from_args(args)
    assert (params.max_tokens, params.temperature, params.n) == (5, 0.5, 2)
    assert (list(params.stop), params.seed) == (["a", "b"], 7)


@pytest.mark.parametrize(
    ("text", "num_bytes"),
    [("65536", 65536), ("512MiB", 512 << 20), ("1.5GB", 1_500_000_000), (" 2 kib ", 2048)],
)
def test_parse_size(text: str, num_bytes: int) -> None:
    assert parse_size(text) == num_bytes


@pytest.mark.parametrize("text", ["", "MiB", "12 parsecs", "-1GB"])
def test_parse_size_rejects_what_is_not_a_size(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="not a size"):
        parse_size(text)


def test_dtype_auto_reaches_the_config_from_every_engine_command():
    from kvpool.cli import build_parser

    for command in (["serve"], ["generate", "hi"], ["chat"]):
        args = build_parser().parse_args([*command, "--dtype", "auto"])
        assert engine_config_from_args(args).load.dtype == "auto"


def test_vllm_flags_at_neutral_values_are_accepted_with_one_warning(caplog):
    from kvpool.cli import build_parser

    args = build_parser().parse_args([
        "serve", "org/model", "--pipeline-parallel-size", "1", "--enforce-eager",
        "--trust-remote-code", "--disable-log-stats", "--tokenizer", "org/model",
        "--tokenizer-mode", "auto", "--revision", "main", "--no-enable-lora",
        "--compilation-config", '{"level": 3}'])
    with caplog.at_level(logging.WARNING, logger="kvpool.engine.vllm_compat"):
        config = engine_config_from_args(args)
    assert config.load.model == "org/model"
    [warning] = [r.getMessage() for r in caplog.records if r.name == "kvpool.engine.vllm_compat"]
    assert "pipeline_parallel_size=1" in warning and "enable_lora=False" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kvpool.engine.vllm_compat"):
        engine_config_from_args(build_parser().parse_args(["serve"]))
    assert not caplog.records  # no vLLM flag given, nothing to warn about


@pytest.mark.parametrize(("flags", "message"), [
    (["-pp", "2"], "pipeline_parallel_size must be 1"),
    (["--enable-lora"], "enable_lora must be False"),
    (["--tokenizer", "other/tokenizer"], "tokenizer must be None or the model"),
    (["--download-dir", "/models"], "set HF_HUB_CACHE"),
])
def test_vllm_flags_kvpool_cannot_honour_are_refused(flags, message):
    parser = argparse.ArgumentParser()
    add_engine_args(parser, model_positional=True)
    with pytest.raises(ValueError, match=message):
        engine_config_from_args(parser.parse_args(flags))


def test_vllm_names_of_kvpool_flags_and_generation_config_flags():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--kv-cache-memory-bytes", "256MiB", "--num-gpu-blocks-override",
                              "12", "--generation-config", "vllm",
                              "--override-generation-config", '{"temperature": 0.5}'])
    config = engine_config_from_args(args)
    assert (config.cache.kv_cache_memory, config.cache.num_gpu_blocks) == (256 << 20, 12)
    assert config.load.generation_config == "vllm"
    assert config.load.override_generation_config == {"temperature": 0.5}
    defaults = engine_config_from_args(parser.parse_args([]))
    assert (defaults.load.generation_config,
            defaults.load.override_generation_config) == ("auto", None)


def test_override_generation_config_must_be_a_json_object(capsys):
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--override-generation-config", "[1, 2]"])
    assert "not a JSON object" in capsys.readouterr().err


def test_cuda_graph_flags_are_vllms():
    from kvpool.cli import build_parser

    args = build_parser().parse_args([
        "serve", "--enforce-eager", "--cudagraph-capture-sizes", "1", "2", "8",
        "--max-cudagraph-capture-size", "8"])
    load = engine_config_from_args(args).load
    assert load.enforce_eager and load.cudagraph_capture_sizes == (1, 2, 8)
    assert load.max_cudagraph_capture_size == 8
    args = build_parser().parse_args(["serve", "--cuda-graph-sizes", "4", "2"])
    load = engine_config_from_args(args).load
    assert not load.enforce_eager and load.cudagraph_capture_sizes == (2, 4)

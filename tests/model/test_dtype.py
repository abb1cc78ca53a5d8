"""`dtype="auto"`: bfloat16 where the device runs it natively, float32 elsewhere; explicit names
pass through; anything else is refused with the allowed names listed."""

from __future__ import annotations

import argparse
import contextlib

import pytest
import torch

from kvpool.cli.args import add_engine_args, engine_config_from_args
from kvpool.engine.config import EngineConfig
from kvpool.model import dtype as dtype_module
from kvpool.model.dtype import cpu_flags_have_fast_bf16, resolve_dtype

SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ICE_LAKE = "processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512bw avx512_vnni\n"


@pytest.fixture
def fast_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_module, "cpu_has_fast_bf16", lambda: True)


@pytest.fixture
def slow_bf16_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dtype_module, "cpu_has_fast_bf16", lambda: False)


@pytest.mark.parametrize(
    ("cpuinfo", "expected"),
    [
        (SAPPHIRE_RAPIDS, True),
        ("flags\t: avx512f avx512_bf16\n", True),  # Cooper Lake, Zen 4: AVX-512 BF16 only
        ("flags\t: avx512f amx_bf16\n", True),
        (ICE_LAKE, False),  # AVX-512 without bf16: torch's capability says "AVX512" here too
        ("model name\t: avx512_bf16 in a name is not a flag\nflags\t: sse\n", False),
        ("", False),
    ],
)
def test_cpu_flags_decide_whether_bf16_is_fast(cpuinfo: str, expected: bool) -> None:
    assert cpu_flags_have_fast_bf16(cpuinfo) is expected


def test_auto_is_bfloat16_on_a_cpu_with_bf16_instructions(fast_bf16_cpu) -> None:
    assert resolve_dtype("auto", "cpu") == torch.bfloat16


def test_auto_is_float32_on_a_cpu_without_them(slow_bf16_cpu) -> None:
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "meta") == torch.float32


def test_auto_on_cuda_does_not_count_emulated_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    emulated_only = lambda including_emulation=True: including_emulation  # noqa: E731 (sm75)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulated_only)
    assert resolve_dtype("auto", "cuda") == torch.float32


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("float32", torch.float32), ("float", torch.float32), ("fp32", torch.float32),
        ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16),
        ("float16", torch.float16), ("half", torch.float16), ("fp16", torch.float16),
        (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32),
    ],
)  # fmt: skip
def test_explicit_dtypes_pass_through_whatever_the_device(name, expected, fast_bf16_cpu) -> None:
    assert resolve_dtype(name, "cpu") == expected


@pytest.mark.parametrize("bad", ["float64", "int8", "bfloat", "", "AUTO", torch.float64])
def test_unknown_dtypes_are_refused_with_the_allowed_names(bad) -> None:
    with pytest.raises(ValueError, match=r"dtype must be one of auto, float32, .*bfloat16"):
        resolve_dtype(bad)
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineConfig(dtype=bad)


def test_the_config_defaults_to_auto_and_normalises_names() -> None:
    assert EngineConfig().load.dtype == "auto"
    assert EngineConfig(dtype="bf16").load.dtype == "bfloat16"
    assert EngineConfig(dtype="half").load.dtype == "float16"
    assert EngineConfig(dtype=torch.float32).load.dtype == "float32"


def test_the_dtype_flag_defaults_to_auto_and_takes_vllm_names(capsys) -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).load.dtype == "auto"
    assert engine_config_from_args(parser.parse_args(["--dtype", "half"])).load.dtype == "float16"
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])
    assert "invalid choice: 'float64'" in capsys.readouterr().err


@pytest.mark.parametrize(("fast", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_the_engine_resolves_auto_once_for_model_and_kv_cache(
    monkeypatch: pytest.MonkeyPatch, fast: bool, expected: torch.dtype
) -> None:
    from kvpool.engine.engine import LLMEngine

    monkeypatch.setattr(dtype_module, "cpu_has_fast_bf16", lambda: fast)
    config = EngineConfig(model="tiny", load_format="dummy", num_gpu_blocks=8,
                          attention_backend="torch", enable_warmup=False)
    engine = LLMEngine(config)
    assert config.load.dtype == "auto"
    assert engine.dtype == engine.runner.model.dtype == expected
    assert engine.kv_memory.kv_cache.tensor.dtype == expected


def test_a_given_model_keeps_its_dtype_and_an_explicit_mismatch_is_refused() -> None:
    from kvpool.engine.setup import build_engine_parts
    from kvpool.model.loaders import load_model

    loaded = load_model("tiny", load_format="dummy", dtype="float32")
    options = {"num_gpu_blocks": 8, "attention_backend": "torch"}
    assert build_engine_parts(EngineConfig(**options), loaded).dtype == torch.float32
    with pytest.raises(ValueError, match="dtype='bfloat16' was asked for, but the model given"):
        build_engine_parts(EngineConfig(dtype="bfloat16", **options), loaded)

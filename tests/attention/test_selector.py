"""Choosing the attention backend: names, devices, and no Triton import on the CPU path."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvpool.attention import selector
from kvpool.attention.cpu_backend import CpuAttentionBackend
from kvpool.attention.torch_ref import TorchAttentionBackend


def test_auto_means_the_cpu_kernels_on_the_cpu_and_triton_on_cuda(monkeypatch):
    monkeypatch.setattr(selector, "is_triton_available", lambda: True)
    monkeypatch.setattr(selector, "cpu_kernels_available", lambda: True)
    assert selector.resolve_backend_name("auto", "cpu") == "cpu"
    assert selector.resolve_backend_name("auto", None) == "cpu"
    monkeypatch.setattr(selector, "cpu_kernels_available", lambda: False)
    assert selector.resolve_backend_name("auto", "cpu") == "torch"
    assert selector.resolve_backend_name("auto", "cuda") == "triton"
    assert selector.resolve_backend_name("auto", "cuda:1") == "triton"


def test_auto_falls_back_to_torch_without_triton(monkeypatch):
    monkeypatch.setattr(selector, "is_triton_available", lambda: False)
    assert selector.resolve_backend_name("auto", "cuda") == "torch"
    with pytest.raises(ValueError, match="needs the triton package"):
        selector.resolve_backend_name("triton", "cuda")


def test_triton_on_the_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setattr(selector, "is_triton_available", lambda: True)
    monkeypatch.setattr(selector, "is_triton_interpreter_on", lambda: False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        selector.resolve_backend_name("triton", "cpu")
    monkeypatch.setattr(selector, "is_triton_interpreter_on", lambda: True)
    assert selector.resolve_backend_name("triton", "cpu") == "triton"


def test_interpreter_is_on_with_the_environment_variable(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert selector.is_triton_interpreter_on()


def test_the_cpu_backend_runs_on_the_cpu_only():
    with pytest.raises(ValueError, match="runs on the CPU"):
        selector.resolve_backend_name("cpu", "cuda")
    assert isinstance(selector.get_attention_backend("cpu", "cpu"), CpuAttentionBackend)


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        selector.resolve_backend_name("flash", "cpu")


def test_torch_backend_instances():
    assert isinstance(selector.get_attention_backend("torch", "cuda"), TorchAttentionBackend)
    assert isinstance(selector.get_attention_backend("torch", "cpu"), TorchAttentionBackend)
    assert type(selector.get_attention_backend("torch")) is TorchAttentionBackend


def test_the_cpu_path_never_imports_triton():
    code = (
        "import sys\n"
        "from kvpool.attention.selector import get_attention_backend\n"
        "import kvpool.engine.llm\n"
        "assert get_attention_backend('auto', 'cpu').name in ('cpu', 'torch')\n"
        "assert 'triton' not in sys.modules, 'triton was imported'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]

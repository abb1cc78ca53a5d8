"""Choosing the attention backend by name: "auto", "cpu", "torch" or "triton".

"auto" means Triton on a CUDA device when Triton imports; on the CPU, the C++ decode kernel
("cpu") when it builds here; the PyTorch reference ("torch") otherwise. Backends are imported
only once chosen, so the CPU path never imports Triton unless asked.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import TYPE_CHECKING

from kvpool.kernels.cpu_kernels import (
    CpuKernelsUnavailable,
    cpu_kernels_available,
    load_cpu_kernels,
)

if TYPE_CHECKING:
    import torch

    from kvpool.attention.backend import AttentionBackend

ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")


def _device_type(device: torch.device | str | None) -> str:
    if device is None:
        return "cpu"
    return str(device).split(":")[0]  # "cuda:1" and torch.device("cuda", 1) alike


def is_triton_available() -> bool:
    """True when the `triton` package imports (it may be installed yet broken, e.g. no compiler)."""
    if importlib.util.find_spec("triton") is None:
        return False
    try:
        import triton  # noqa: F401
    except Exception:  # a broken install must not break the CPU path
        return False
    return True


def is_triton_interpreter_on() -> bool:
    """True when Triton kernels run in its CPU interpreter (TRITON_INTERPRET=1, or the knob
    set by a process that imported triton that way). Never imports triton itself."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    triton = sys.modules.get("triton")
    knobs = getattr(triton, "knobs", None)  # triton >= 3.4
    return bool(knobs is not None and knobs.runtime.interpret)


def resolve_backend_name(name: str, device: torch.device | str | None = None) -> str:
    """The concrete backend ("cpu", "torch" or "triton") that `name` means on `device`."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {ATTENTION_BACKENDS}")
    device_type = _device_type(device)
    if name == "auto":
        if device_type == "cuda":
            return "triton" if is_triton_available() else "torch"
        return "cpu" if device_type == "cpu" and cpu_kernels_available() else "torch"
    if name == "cpu":
        if device_type != "cpu":
            raise ValueError(f"attention backend 'cpu' runs on the CPU (got {device_type!r})")
        try:
            load_cpu_kernels()
        except CpuKernelsUnavailable as error:
            raise ValueError(f"attention backend 'cpu' is unavailable: {error}") from error
    if name == "triton":
        if not is_triton_available():
            raise ValueError("attention backend 'triton' needs the triton package")
        if device_type != "cuda" and not is_triton_interpreter_on():
            raise ValueError(
                f"attention backend 'triton' runs on CUDA devices (got {device_type!r}); "
                "on the CPU only under TRITON_INTERPRET=1, Triton's interpreter"
            )
    return name


def get_attention_backend(
    name: str = "auto", device: torch.device | str | None = None
) -> AttentionBackend:
    """An attention backend instance for `device` ("auto", "cpu", "torch" or "triton")."""
    resolved = resolve_backend_name(name, device)
    if resolved == "triton":
        from kvpool.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    if resolved == "cpu":
        from kvpool.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    from kvpool.attention.torch_ref import TorchAttentionBackend

    return TorchAttentionBackend()

"""The model's dtype: from the name a user gives (`--dtype`, `EngineConfig.dtype`) to a torch dtype.

`"auto"`, the default, is vLLM's name; it picks bfloat16 where the device runs bf16 matmuls
natively, and float32 elsewhere:

- CUDA: compute capability 8.0 or newer (`torch.cuda.is_bf16_supported` without emulation);
- CPU: AVX-512 BF16 or AMX-BF16 (the `avx512_bf16` / `amx_bf16` flags in /proc/cpuinfo).
  `torch.backends.cpu.get_cpu_capability()` cannot tell: it says "AVX512" for every AVX-512
  CPU, Skylake included, where oneDNN emulates bf16 matmuls more slowly than fp32 ones.

Unlike vLLM's "auto" (the checkpoint's own dtype) this follows the device: GGUF weights are
quantized and dequantized at load, so the checkpoint says nothing about the compute dtype.

The resolution happens once, where the engine loads its model (`kvpool.engine.setup`); after
that the model's `dtype` is a concrete torch dtype and nothing else reads the name. This module
imports torch only when it resolves, so the CLI's parser can list `DTYPE_CHOICES` cheaply.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

AUTO = "auto"
# Every accepted name -> torch's name for it; vLLM's names ("half", "float") included.
_CANONICAL_NAMES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float16": "float16", "fp16": "float16", "half": "float16",
}  # fmt: skip
DTYPE_NAMES = (AUTO, *_CANONICAL_NAMES)  # everything `resolve_dtype` accepts
DTYPE_CHOICES = (AUTO, "bfloat16", "float16", "float32", "half", "float")  # `--dtype`: vLLM's
CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
CPUINFO = Path("/proc/cpuinfo")


def canonical_dtype_name(dtype: str | torch.dtype) -> str:
    """"auto", "float32", "bfloat16" or "float16" for any accepted name or torch dtype;
    ValueError naming the allowed values otherwise."""
    name = str(dtype).removeprefix("torch.")
    if name == AUTO:
        return AUTO
    if name not in _CANONICAL_NAMES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
    return _CANONICAL_NAMES[name]


def cpu_flags_have_fast_bf16(cpuinfo: str) -> bool:
    """Whether /proc/cpuinfo text lists a native bf16 matmul instruction set."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags" and CPU_BF16_FLAGS & set(value.split()):
            return True
    return False


@functools.cache
def cpu_has_fast_bf16() -> bool:
    """Whether this machine's CPU has AVX-512 BF16 or AMX-BF16 (False where /proc/cpuinfo
    cannot be read: macOS, Windows)."""
    try:
        return cpu_flags_have_fast_bf16(CPUINFO.read_text())
    except OSError:
        return False


def device_has_fast_bf16(device: torch.device | str) -> bool:
    """Whether `device` runs bf16 natively (see the module docstring)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        with torch.cuda.device(device):
            return torch.cuda.is_bf16_supported(including_emulation=False)
    if device.type == "cpu":
        return cpu_has_fast_bf16()
    return False


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | str = "cpu") -> torch.dtype:
    """The concrete torch dtype for `dtype` on `device`: "auto" is bfloat16 where the device
    runs it natively, else float32; other names and torch dtypes pass through."""
    import torch

    name = canonical_dtype_name(dtype)
    if name == AUTO:
        return torch.bfloat16 if device_has_fast_bf16(device) else torch.float32
    return getattr(torch, name)

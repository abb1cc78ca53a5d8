"""The `env` step: what the machine is, and its ceilings.

Records, in order: `environment` (versions, device name, SMs, memory, L2), `read_bandwidth`
(a reduction over 4 GiB: the ceiling for decode attention and a decode step), `copy_bandwidth`
(a 4 GiB device-to-device copy, bytes read + written) and `matmul` (one 8192³ bf16 product).
A smoke run uses 16 MiB and 256³.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import platform

from benchmarks.gpu.step import StepContext

# Module -> its distribution: what the check runs on, and what the image may lack (gguf).
PACKAGES = {"triton": "triton", "transformers": "transformers", "safetensors": "safetensors",
            "gguf": "gguf", "pytest": "pytest", "xdist": "pytest-xdist"}
FULL_MATMUL_SIZE = 8192
SMOKE_MATMUL_SIZE = 256


def run(ctx: StepContext) -> None:
    from benchmarks.device_timing import copy_bandwidth, read_bandwidth

    device = ctx.device
    ctx.attempt("environment", environment)
    ctx.attempt("read_bandwidth", lambda: read_bandwidth(device, ctx.bandwidth_bytes))
    ctx.attempt("copy_bandwidth", lambda: copy_bandwidth(device, ctx.bandwidth_bytes))
    size = SMOKE_MATMUL_SIZE if ctx.smoke else FULL_MATMUL_SIZE
    ctx.attempt("matmul", lambda: _matmul(device, size))


def _matmul(device, size: int) -> dict:
    import torch

    from benchmarks.device_timing import matmul_rate

    return matmul_rate(device, size, torch.bfloat16)


def environment() -> dict:
    """Versions of what the check uses, and the device's facts when it is CUDA."""
    import torch

    info = {"python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "packages": package_versions(PACKAGES)}
    if torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(0)
        info |= {
            "device_name": properties.name,
            "num_gpus": torch.cuda.device_count(),
            "num_sms": properties.multi_processor_count,
            "memory_bytes": properties.total_memory,
            "l2_cache_bytes": getattr(properties, "L2_cache_size", None),
            "capability": list(torch.cuda.get_device_capability(0)),
        }
    return info


def package_versions(packages: dict[str, str]) -> dict[str, str]:
    """Each distribution's version once its module imports, or why it does not (an absent
    package is a fact worth recording here, not an error)."""
    versions = {}
    for module, distribution in packages.items():
        try:
            importlib.import_module(module)
            versions[distribution] = importlib.metadata.version(distribution)
        except Exception as error:
            versions[distribution] = f"unavailable: {type(error).__name__}: {error}"
    return versions

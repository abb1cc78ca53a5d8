"""Timing helpers and the machine's ceilings (read and copy bandwidth, matmul rate), shared by
the GPU benchmarks.

On CUDA, kernels are timed with `triton.testing.do_bench` (CUDA events, the L2 cache flushed
before every run, median of the runs), so a small working set is not measured out of L2. On the
CPU (smoke runs only) a median of wall-clock runs stands in.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_seconds(
    fn: Callable[[], object], device: torch.device, budget_ms: float = 60.0
) -> float:
    """Median run time of `fn` in seconds."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(fn, warmup=max(5.0, budget_ms / 4), rep=budget_ms) / 1e3
    fn()  # warm-up
    runs = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - start)
    return statistics.median(runs)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def read_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """Read rate of a reduction (`x.sum()`) over `nbytes` of float32, bytes read per second:
    the ceiling of a kernel that streams its inputs and writes next to nothing, such as
    decode attention and a decode step's weight reads."""
    data = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    nbytes = data.numel() * data.element_size()
    seconds = median_seconds(data.sum, device, budget_ms=200.0)
    return {"nbytes": nbytes, "seconds": seconds, "bytes_per_s": nbytes / seconds}


def copy_bandwidth(device: torch.device, nbytes: int) -> dict[str, float]:
    """Device-to-device copy rate, counting bytes read plus bytes written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    src.random_(0, 255)
    dst = torch.empty_like(src)
    seconds = median_seconds(lambda: dst.copy_(src), device, budget_ms=200.0)
    return {"nbytes": nbytes, "seconds": seconds, "bytes_per_s": 2 * nbytes / seconds}


def matmul_rate(device: torch.device, size: int, dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of one `size`-cubed matrix product in `dtype` on random data (2 size³ FLOPs)."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=generator, device=device).to(dtype)
    b = torch.randn(size, size, generator=generator, device=device).to(dtype)
    seconds = median_seconds(lambda: a @ b, device, budget_ms=200.0)
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "seconds": seconds,
            "flop_per_s": 2 * size**3 / seconds}

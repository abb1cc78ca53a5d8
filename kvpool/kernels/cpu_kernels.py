"""Building and loading kvpool's C++ CPU kernels (`csrc/`: paged decode attention and the
model's fused elementwise ops), once per machine.

The kernels are compiled on first use with `torch.utils.cpp_extension` (a C++ compiler and
ninja are needed) into torch's extension cache (`TORCH_EXTENSIONS_DIR`, by default
`~/.cache/torch_extensions`); later processes only load the built library (well under a
second). They register themselves as `torch.ops.kvpool_cpu.*`.

They are built for this machine's CPU (`-march=native`), so the cache entry's name carries a
fingerprint of the CPU's model and flags: a home directory shared between different machines
never loads code built for another instruction set. `-ffast-math` lets the compiler vectorise
`exp` and reassociate the dot-product sums (compile step only: the process's floating-point
mode is untouched). The headers the sources include (`HEADERS`) are hashed into the build's
flags, because torch's rebuild check hashes only the sources. When the build fails the caller
falls back to the PyTorch path with one warning naming the cause; `KVPOOL_CPU_KERNELS=0` skips
the kernels altogether.

Each checkout builds in its own directory (`build_directory`: Python, torch, and a hash of the
sources' path), so two clones never rebuild over each other. Builders and loaders take a
kvpool-owned `flock` (released by the kernel when its process dies) before torch's own `lock`
file: torch waits forever on a `lock` left by a killed build, and under our flock any such file
is known stale and removed.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from pathlib import Path

from filelock import FileLock, Timeout

CSRC_DIR = Path(__file__).parent / "csrc"
SOURCES = ("paged_decode.cpp", "fused_ops.cpp", "quant_matmul.cpp", "dequant_matmul.cpp")
HEADERS = ("kv_load.h", "quant_layout.h")
COMPILE_FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffast-math")
# Linking with -fopenmp records libgomp.so.1, the soname of the libgomp torch ships and has
# already loaded, so at::parallel_for runs on torch's own OpenMP pool, never a second one.
LINK_FLAGS = ("-fopenmp",)
# A cold build takes under a minute on two cores; a waiter gives up (PyTorch path) after this.
BUILD_WAIT_SECONDS = 600.0


class CpuKernelsUnavailable(RuntimeError):
    """The C++ kernels could not be built or loaded here (the reason is the message)."""


def cpu_fingerprint() -> str:
    """A short hash of this CPU's model name and instruction-set flags."""
    cpuinfo = Path("/proc/cpuinfo")
    text = cpuinfo.read_text() if cpuinfo.exists() else ""
    lines = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    identity = "\n".join([platform.machine(), *lines])
    return hashlib.sha256(identity.encode()).hexdigest()[:10]


def headers_digest() -> str:
    """A short hash of the headers' text, passed as a (never read) define so that a change to a
    header alone rebuilds the kernels."""
    digest = hashlib.sha256()
    for header in HEADERS:
        digest.update((CSRC_DIR / header).read_bytes())
    return digest.hexdigest()[:10]


def is_disabled() -> bool:
    """True when `KVPOOL_CPU_KERNELS=0` turns the kernels off."""
    return os.environ.get("KVPOOL_CPU_KERNELS", "1") == "0"


def extension_name() -> str:
    """The library's name: one per CPU fingerprint (`-march=native` code is CPU-specific)."""
    return f"kvpool_cpu_kernels_{cpu_fingerprint()}"


def extensions_root() -> Path:
    """torch's extension root: `TORCH_EXTENSIONS_DIR`, else its user cache directory."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def build_directory() -> Path:
    """Where this checkout's build lives, under torch's extension root (`TORCH_EXTENSIONS_DIR`).

    The directory names Python and torch (the library links against both) and hashes the
    sources' path: torch's build file names sources by absolute path, so two checkouts sharing
    one directory would rebuild on every switch, and a build killed midway blocks the other."""
    import torch

    checkout = hashlib.sha256(str(CSRC_DIR.resolve()).encode()).hexdigest()[:10]
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    runtime = f"{python}-torch{torch.__version__}".replace("+", "-")
    return extensions_root() / "kvpool" / runtime / f"{extension_name()}-{checkout}"


def build_lock(directory: Path, timeout: float = BUILD_WAIT_SECONDS) -> FileLock:
    """The flock every builder and loader of `directory` holds; the kernel drops it with its
    process, so a killed build never leaves the next one waiting."""
    directory.mkdir(parents=True, exist_ok=True)
    return FileLock(directory / "kvpool.lock", timeout=timeout)


@functools.cache
def load_cpu_kernels() -> None:
    """Build (first time on this machine) and load the kernels; raise `CpuKernelsUnavailable`
    with the reason when that is not possible. Cached: later calls return at once."""
    if is_disabled():
        raise CpuKernelsUnavailable("turned off by KVPOOL_CPU_KERNELS=0")
    if platform.system() != "Linux":
        raise CpuKernelsUnavailable(f"built on Linux only, not {platform.system()}")
    from torch.utils import cpp_extension

    directory = build_directory()
    try:
        with build_lock(directory):
            # torch's own baton: while we hold our flock nobody is building, so it is stale.
            (directory / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=extension_name(),
                sources=[str(CSRC_DIR / source) for source in SOURCES],
                extra_cflags=[*COMPILE_FLAGS, f"-DKVPOOL_HEADERS_DIGEST={headers_digest()}"],
                extra_ldflags=list(LINK_FLAGS),
                build_directory=str(directory),
                is_python_module=False,
            )
    except Timeout as error:
        raise CpuKernelsUnavailable(
            f"another process has held {error.lock_file} for over {BUILD_WAIT_SECONDS:.0f} s"
        ) from error
    except Exception as error:  # no compiler, no ninja, a failed build: all mean "not here"
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise CpuKernelsUnavailable(f"{type(error).__name__}: {first_line}") from error


@functools.cache
def cpu_kernels_available() -> bool:
    """True when the kernels load; on the first failure warns once with the reason."""
    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable as error:
        if not is_disabled():
            warnings.warn(
                f"kvpool's C++ CPU kernels are unavailable ({error}); using the PyTorch "
                "attention path, which is slower",
                RuntimeWarning,
                stacklevel=2,
            )
        return False
    return True


def main() -> None:
    """`python -m kvpool.kernels.cpu_kernels` (run by `make setup`): build the kernels now, so
    the first engine does not wait for the compiler. Never fails: without the kernels kvpool
    runs on the PyTorch path."""
    try:
        load_cpu_kernels()
    except CpuKernelsUnavailable as error:
        print(f"kvpool CPU kernels unavailable ({error}); the PyTorch attention path will be used")
        return
    print(f"kvpool CPU kernels ready ({build_directory()})")


if __name__ == "__main__":
    main()

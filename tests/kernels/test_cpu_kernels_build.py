"""Building the C++ kernels survives what interrupted builds leave behind: torch's stale `lock`
file, and a builder killed while it holds kvpool's own lock."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import Timeout

from kvpool.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(
    not cpu_kernels.cpu_kernels_available(), reason="no C++ toolchain"
)


def _run_build(extensions_root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions_root)}
    return subprocess.run(
        [sys.executable, "-m", "kvpool.kernels.cpu_kernels"],
        env=env, capture_output=True, text=True, timeout=300,
    )


def test_a_lock_left_by_a_killed_torch_build_does_not_block_the_next_one(tmp_path):
    # This checkout's finished build, copied (mtimes kept, so ninja finds it up to date) under a
    # fresh root, plus the empty `lock` file a torch build killed midway leaves: torch alone
    # would wait on it forever.
    built = cpu_kernels.build_directory()
    relative = built.relative_to(cpu_kernels.extensions_root())
    copied = tmp_path / relative
    shutil.copytree(built, copied, ignore=shutil.ignore_patterns("*.lock"))
    (copied / "lock").touch()

    result = _run_build(tmp_path)

    assert result.returncode == 0, result.stderr
    assert "kvpool CPU kernels ready" in result.stdout, result.stdout + result.stderr
    assert not (copied / "lock").exists()


def test_two_checkouts_build_in_different_directories(tmp_path, monkeypatch):
    here = cpu_kernels.build_directory()
    monkeypatch.setattr(cpu_kernels, "CSRC_DIR", tmp_path / "another-checkout" / "csrc")
    elsewhere = cpu_kernels.build_directory()
    assert here != elsewhere and here.parent == elsewhere.parent
    assert cpu_kernels.extension_name() in here.name


def test_a_waiter_gives_up_after_its_timeout_while_a_build_holds_the_lock(tmp_path):
    with cpu_kernels.build_lock(tmp_path), pytest.raises(Timeout):
        cpu_kernels.build_lock(tmp_path, timeout=0.2).acquire()


def test_a_builder_killed_while_holding_the_lock_releases_it(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from kvpool.kernels import cpu_kernels; "
         "lock = cpu_kernels.build_lock(Path(sys.argv[1])); lock.acquire(); "
         "print('held', flush=True); "
         "time.sleep(600)", str(tmp_path)],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(Timeout):
            cpu_kernels.build_lock(tmp_path, timeout=0.2).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        # acquire raises Timeout unless the kernel released the dead holder's lock
        with cpu_kernels.build_lock(tmp_path, timeout=10):
            pass
    finally:
        holder.kill()
        holder.wait()

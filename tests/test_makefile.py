"""The Makefile's set-up split: `make demo` (and `make setup`) needs pip only, no root, no
Debian packages, no Chromium, Redis or Mooncake's libraries; only the test targets install those
(`setup-test`).
Read from `make -n` (print the recipes, run nothing)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SYSTEM_PACKAGES = re.compile(r"apt-get|chromium|chromedriver|redis", re.IGNORECASE)

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def dry_run(target: str) -> str:
    """What `make <target>` would run, in a checkout with no .venv yet."""
    result = subprocess.run(["make", "-n", "-B", "-C", str(ROOT), target], capture_output=True,
                            text=True, timeout=60, check=True)
    return result.stdout


@pytest.mark.parametrize("target", ["demo", "setup"])
def test_demo_and_setup_need_pip_only(target: str) -> None:
    recipe = dry_run(target)
    assert "pip" in recipe
    assert not SYSTEM_PACKAGES.search(recipe), SYSTEM_PACKAGES.search(recipe)


@pytest.mark.parametrize("target", ["test", "test-fast", "setup-test"])
def test_the_test_targets_install_chromium_redis_and_mooncakes_libraries(target: str) -> None:
    recipe = dry_run(target)
    assert "apt-get" in recipe
    assert "chromium-driver" in recipe and "redis-server" in recipe
    assert "libibverbs1 librdmacm1 libnuma1" in recipe
    assert "pip" in recipe


def test_setup_installs_the_mooncake_extra_for_its_tests() -> None:
    assert ".[dev,mooncake]" in dry_run("setup")

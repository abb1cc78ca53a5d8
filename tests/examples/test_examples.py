"""Every script in examples/ (engine-level user examples) runs on its own and exits 0.

The seed's four memory experiments live in the package, `kvpool.experiments`; they are tested in
tests/experiments/test_experiments.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_PATHS = sorted(EXAMPLES_DIR.glob("*.py"))


def test_the_examples_exist() -> None:
    assert "05_elastic_pool.py" in {path.name for path in EXAMPLE_PATHS}


@pytest.mark.parametrize("path", EXAMPLE_PATHS, ids=lambda path: path.name)
def test_example_runs(path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr

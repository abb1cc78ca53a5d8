"""Every script in examples/ runs on its own, exits 0 and prints the line that states its claim."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_PATHS = sorted(EXAMPLES_DIR.glob("*.py"))

# The line each seed experiment prints when its claim holds (the script also asserts it).
KEY_LINES = {
    "01_refcount.py": "all 16 blocks free again: no leak (2 allocations, 2 frees)",
    "02_block_table.py": "A decoded 7 tokens; a new block was taken only at positions [8, 12]",
    "03_fragmentation.py": "contiguous: C asks for 25 blocks -> FAILS",
    "04_prefix_sharing.py": "blocks used: 7 with sharing, 10 without: 3 blocks saved",
}


def test_the_four_seed_experiments_exist() -> None:
    assert set(KEY_LINES) <= {path.name for path in EXAMPLE_PATHS}


@pytest.mark.parametrize("path", EXAMPLE_PATHS, ids=lambda path: path.name)
def test_example_runs_and_states_its_claim(path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    key_line = KEY_LINES.get(path.name)
    if key_line is not None:
        assert key_line in result.stdout.splitlines(), result.stdout


def test_fragmentation_paged_pool_succeeds_where_contiguous_fails() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLES_DIR / "03_fragmentation.py")],
        capture_output=True, text=True, timeout=120, check=True,
    )
    lines = result.stdout.splitlines()
    assert any("largest free run 20" in line for line in lines)
    assert any(line.startswith("paged:      C asks for 25 blocks -> succeeds") for line in lines)

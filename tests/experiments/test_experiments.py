"""The seed's four memory experiments ship in the package: each runs as a module
(`python -m kvpool.experiments.<name>`), exits 0 and prints the line that states its claim, and
its `main()` returns its pool, consistent and with nothing leaked."""

from __future__ import annotations

import subprocess
import sys
from importlib import import_module

import pytest

from kvpool.experiments import SEED_EXPERIMENTS
from kvpool.memory import BlockPool

# The line each seed experiment prints when its claim holds (the module also asserts it).
KEY_LINES = {
    "refcount": "all 16 blocks free again: no leak (2 allocations, 2 frees)",
    "block_table": "A decoded 7 tokens; a new block was taken only at positions [8, 12]",
    "fragmentation": "contiguous: C asks for 25 blocks -> FAILS",
    "prefix_sharing": "blocks used: 7 with sharing, 10 without: 3 blocks saved",
}


def _run_module(name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", f"kvpool.experiments.{name}"],
        capture_output=True, text=True, timeout=120, check=False,
    )


def test_the_four_seed_experiments_are_shipped() -> None:
    assert tuple(KEY_LINES) == SEED_EXPERIMENTS


@pytest.mark.parametrize("name", SEED_EXPERIMENTS)
def test_experiment_runs_as_a_module_and_states_its_claim(name: str) -> None:
    result = _run_module(name)
    assert result.returncode == 0, result.stderr
    assert KEY_LINES[name] in result.stdout.splitlines(), result.stdout


@pytest.mark.parametrize("name", SEED_EXPERIMENTS)
def test_main_returns_its_pool(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    pool = import_module(f"kvpool.experiments.{name}").main()
    assert isinstance(pool, BlockPool)
    pool.check_invariants()
    assert KEY_LINES[name] in capsys.readouterr().out.splitlines()


def test_fragmentation_paged_pool_succeeds_where_contiguous_fails() -> None:
    result = _run_module("fragmentation")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any("largest free run 20" in line for line in lines)
    assert any(line.startswith("paged:      C asks for 25 blocks -> succeeds") for line in lines)

"""The line between kvpool and its development benchmarks: kvpool never imports `benchmarks`
(the wheel ships `kvpool*` only), and every development benchmark imports from the repository
root, as `python -m benchmarks.<name>` runs it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARK_MODULES = sorted(path.stem for path in (REPO / "benchmarks").glob("*.py")
                           if path.stem != "__init__")


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_kvpool_never_imports_the_development_benchmarks():
    offenders = sorted(
        str(path.relative_to(REPO)) for path in (REPO / "kvpool").rglob("*.py")
        if any(name == "benchmarks" or name.startswith("benchmarks.")
               for name in _imported_modules(path)))
    assert offenders == []


def test_the_wheel_ships_kvpool_alone():
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split("[tool.setuptools.packages.find]\n", 1)[1].split("\n[", 1)[0]
    assert section.strip() == 'include = ["kvpool*"]'


@pytest.mark.parametrize("name", BENCHMARK_MODULES)
def test_every_benchmark_module_imports(name):
    # vllm_runner runs in vLLM's venv and imports vllm only inside its run.
    assert importlib.import_module(f"benchmarks.{name}").__name__ == f"benchmarks.{name}"

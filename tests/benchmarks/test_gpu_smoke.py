"""The whole GPU check, real steps, in `--smoke` mode on this machine (tiny shapes; Triton in its
interpreter without CUDA): it succeeds, stays within what the device tool brings back (at most 8
files), and every step records what the GPU run will read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu.results import read_records, records_of

pytestmark = [pytest.mark.slow, pytest.mark.processes]

REPO = Path(__file__).resolve().parents[2]
MAX_FILES = 8  # what the device tool brings back from $OUT


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    out = tmp_path_factory.mktemp("gpu_check")
    env = {**os.environ, "PYTHON": sys.executable,
           "GPU_CHECK_WHEELS": str(out / "no_wheels")}
    result = subprocess.run([str(REPO / "scripts" / "gpu_check.sh"), str(out), "--smoke"],
                            capture_output=True, text=True, env=env, timeout=400)
    return result, out


def test_every_step_passes_within_eight_files(smoke_run):
    result, out = smoke_run
    assert result.returncode == 0, result.stdout[-4000:]
    files = [p for p in out.rglob("*") if p.is_file()]
    assert len(files) <= MAX_FILES, files
    statuses = {r["step"]: r["status"] for r in read_records(out) if r["record"] == "exit"}
    assert statuses == dict.fromkeys(
        ("env", "tests", "e2e", "attention", "engine", "hf", "summary"), "ok")


def test_the_summary_checks_what_a_cpu_can(smoke_run):
    _, out = smoke_run
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["smoke"] is True
    checks = summary["checks"]
    for name in ("tests_passed", "fp32_tokens_identical_to_cpu",
                 "reduced_precision_tokens_close", "sampled_decoding_on_device"):
        assert checks[name]["passed"] is True, name
    # No shape of the smoke run is large enough for the bandwidth targets.
    assert checks["attention_min_fraction_of_read_bandwidth"]["passed"] is None
    assert checks["decode_step_max_over_bound"]["passed"] is None


def test_the_steps_record_their_measurements(smoke_run):
    _, out = smoke_run
    records = read_records(out)
    for name in ("read_bandwidth", "copy_bandwidth", "matmul"):
        assert records_of(records, "env", name)[0]["seconds"] > 0
    shapes = records_of(records, "attention", "shape")
    assert [(s["batch"], s["context"]) for s in shapes] == [(1, 40), (1, 64), (3, 40), (3, 64)]
    assert all(s["max_abs_diff_vs_sdpa"] < 1e-4 for s in shapes)
    assert records_of(records, "attention", "tile_config")
    variants = records_of(records, "e2e", "variant")
    assert [v["name"] for v in variants] == ["fp32_torch", "fp32_triton", "bf16_torch",
                                             "fp32_int8_kv_triton", "fp32_fp8_kv_triton"]
    # Same dummy weights in fp32 on the CPU: the engine and transformers agree token for token.
    engine = records_of(records, "engine", "batch")
    hf = records_of(records, "hf", "batch")
    assert [r["batch"] for r in engine] == [r["batch"] for r in hf] == [1, 3]
    for ours, theirs in zip(engine, hf, strict=True):
        assert ours["first_request_token_ids"] == theirs["first_request_token_ids"]
        assert ours["bound_ms"] > 0 and ours["num_decode_steps"] > 0

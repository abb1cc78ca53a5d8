"""`python -m benchmarks.throughput_baselines`: kvpool's throughput benchmark with vLLM's,
llama.cpp's and transformers' baselines handed to it (`kvpool.bench.throughput.Baseline`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.throughput_baselines import main
from benchmarks.vllm_baseline import longest_request, vllm_kv_cache_gib
from kvpool.bench.throughput import Workload

TINY = ["--model", "tiny", "--load-format", "dummy", "--dtype", "float32"]
REPO = Path(__file__).resolve().parents[2]


def test_throughput_json_runs_each_prefix_of_the_workload_against_transformers(capsys):
    argv = [
        "--json", *TINY, "--num-prompts", "5", "2",
        "--input-len", "4", "12", "--output-len", "2", "6", "--latency-tokens", "3",
        "--baseline", "hf", "--baseline-batch-size", "2", "--kv-cache-memory", "4MiB",
    ]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(report["matmul_peak_gflops_per_s"]) == {"float32", "bfloat16"}
    (result,) = report["dtypes"]
    assert result["dtype"] == "float32"
    requests = Workload(5, (4, 12), (2, 6)).requests(512)
    for label, count in (("5", 5), ("2", 2)):
        run = result["kvpool"]["runs"][label]
        assert run["num_output_tokens"] == sum(out for _, out in requests[:count])
        assert run["peak_blocks_used"] > 0 and run["model_gflops_per_s"] > 0
        assert 0 < run["decode_only_model_seconds"] < run["step_phase_seconds"]["model"]
        assert "token_ids" not in run  # compared, not printed
        assert result["comparison"][label]["over_hf"] > 0
    assert result["kvpool"]["decode_ms_per_token"] > 0
    assert set(result["hf"]["runs"]) == {"5", "2"}


def test_the_vllm_baseline_without_its_venv_fails_before_running_anything(tmp_path, capsys):
    missing = tmp_path / "no-venv" / "python"
    argv = ["--baseline", "vllm", "--vllm-python", str(missing)]
    with pytest.raises(SystemExit, match="make vllm-venv"):
        main(argv)
    assert capsys.readouterr().out == ""  # nothing was measured, so nothing was lost


def test_the_vllm_baseline_needs_real_weights(tmp_path):
    argv = ["--baseline", "vllm", *TINY]
    with pytest.raises(SystemExit, match="real weights"):
        main(argv)


def test_vllm_gets_kvpools_kv_budget_in_whole_gib_rounded_up():
    gib = 1024**3
    assert [vllm_kv_cache_gib(n) for n in (1, gib, gib + 1, 2 * gib - 4096)] == [1, 1, 2, 2]


def test_runs_as_a_module_from_the_repository_root():
    result = subprocess.run([sys.executable, "-m", "benchmarks.throughput_baselines", "--help"],
                            capture_output=True, text=True, cwd=REPO, timeout=120, check=True)
    assert "--baseline" in result.stdout and "--num-prompts" in result.stdout


def test_the_llamacpp_baseline_without_its_venv_fails_before_running_anything(tmp_path, capsys):
    missing = tmp_path / "no-venv" / "python"
    with pytest.raises(SystemExit, match="make llamacpp-venv"):
        main(["--baseline", "llamacpp", "--llamacpp-python", str(missing)])
    assert capsys.readouterr().out == ""


def test_the_llamacpp_baseline_needs_a_gguf_file(tmp_path):
    with pytest.raises(SystemExit, match="needs a GGUF file"):
        main(["--baseline", "llamacpp", *TINY])


def test_vllm_is_sized_for_the_longest_request_not_the_models_context():
    plan = {"runs": [{"label": "2", "requests": [[[1] * 30, 5], [[1] * 10, 40]]}],
            "latency_prompt": [1] * 30, "latency_tokens": 8}
    assert longest_request(plan) == 50

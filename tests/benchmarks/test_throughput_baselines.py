"""`python -m benchmarks.throughput_baselines`: kvpool's throughput benchmark with vLLM's,
llama.cpp's and transformers' baselines handed to it (`kvpool.bench.throughput.Baseline`)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.baseline_process import run_runner
from benchmarks.llamacpp_baseline import DEFAULT_VENV_PYTHON, RUNNER, LlamaCppBaseline, gguf_path
from benchmarks.throughput_baselines import baselines_from_args, build_parser, main
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


def test_llamacpp_batched_gives_every_request_of_the_largest_run_a_sequence():
    runs = [("3", [([1] * 30, 5), ([1] * 10, 40), ([1] * 250, 7)]), ("1", [([1] * 30, 5)])]
    one_at_a_time = LlamaCppBaseline(None, 8).plan(Path("m.gguf"), runs)
    batched = LlamaCppBaseline(None, 8, batched=True).plan(Path("m.gguf"), runs)
    assert "n_seq_max" not in one_at_a_time
    assert batched == {**one_at_a_time, "n_seq_max": 3}
    assert batched["n_ctx"] == 512  # per sequence: the longest request, 257 tokens, rounded up


def test_both_llamacpp_modes_are_baselines_of_their_own():
    args = build_parser().parse_args(["--baseline", "llamacpp", "llamacpp-batched"])
    assert [(b.name, b.label) for b in baselines_from_args(args)] == [
        ("llamacpp", "llama.cpp"), ("llamacpp-batched", "llama.cpp batched")]


def _llamacpp_python() -> Path:
    python = Path(os.environ.get("KVPOOL_LLAMACPP_PYTHON") or REPO / DEFAULT_VENV_PYTHON)
    if not python.exists():
        pytest.skip(f"no llama-cpp-python venv at {python}: `make llamacpp-venv`")
    return python


def _llamacpp_tokens(baseline: LlamaCppBaseline, requests: list, **plan_changes) -> list:
    plan = {**baseline.plan(gguf_path(None), [("3", requests)]), **plan_changes}
    result = run_runner(baseline.label, RUNNER, _llamacpp_python(), plan)
    assert result["decode_ms_per_token"] > 0
    return result["runs"]["3"]["token_ids"]


def test_llamacpp_batched_decodes_the_same_tokens_as_one_at_a_time():
    rng = random.Random(0)
    requests = [([rng.randrange(100, 49152) for _ in range(length)], max_tokens)
                for length, max_tokens in ((12, 8), (30, 3), (5, 6))]
    alone = _llamacpp_tokens(LlamaCppBaseline(None, 2), requests)
    batched = LlamaCppBaseline(None, 2, batched=True)
    together = _llamacpp_tokens(batched, requests)
    # Two sequence ids for three requests: the third waits for the second's to come free.
    in_turn = _llamacpp_tokens(batched, requests, n_seq_max=2)
    for tokens in (alone, together, in_turn):
        assert [len(ids) for ids in tokens] == [8, 3, 6]  # EOS ignored: exactly max_tokens
    # Greedy on the same weights and kernels: batching may move a near tie, so the first
    # tokens are compared, not the whole output.
    assert [ids[:3] for ids in together] == [ids[:3] for ids in alone]
    assert [ids[:3] for ids in in_turn] == [ids[:3] for ids in alone]

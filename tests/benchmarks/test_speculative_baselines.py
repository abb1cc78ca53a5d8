"""`python -m benchmarks.speculative_baselines`: kvpool's speculative benchmark with vLLM's CPU
build beside it, skipped (saying why) where vLLM cannot run."""

from __future__ import annotations

import json

from benchmarks.speculative_baselines import baselines_from_args, build_parser, main
from benchmarks.vllm_speculative import VLLMClosedLoopBaseline, max_model_len
from kvpool.bench.closed_loop import Run
from kvpool.cli.args import engine_config_from_args

TINY = ["--model", "tiny", "--load-format", "dummy", "--dtype", "float32"]


def test_vllm_without_its_venv_is_skipped_saying_why(tmp_path, capsys):
    args = build_parser().parse_args(["--vllm", "--vllm-python", str(tmp_path / "python")])
    assert baselines_from_args(args, engine_config_from_args(args)) == []
    assert "vLLM skipped" in capsys.readouterr().err  # and what to run: make vllm-venv


def test_vllm_runs_only_when_asked(tmp_path):
    python = tmp_path / "python"
    python.touch()
    args = build_parser().parse_args(["--vllm-python", str(python)])
    assert baselines_from_args(args, engine_config_from_args(args)) == []
    args = build_parser().parse_args(["--vllm", "--vllm-python", str(python)])
    (baseline,) = baselines_from_args(args, engine_config_from_args(args))
    assert isinstance(baseline, VLLMClosedLoopBaseline) and baseline.warmup


def test_kvpool_runs_alone_when_vllm_cannot(tmp_path, capsys):
    path = tmp_path / "report.json"
    argv = [*TINY, "--vllm", "--workloads", "open", "--concurrency", "2", "--num-prompts", "2",
            "--num-speculative-tokens", "2", "--output-len", "4", "--input-len", "4", "8",
            "--rounds", "1", "--num-gpu-blocks", "32", "--output-json", str(path)]
    assert main(argv) == 0
    assert "vLLM skipped: --baseline vllm needs real weights" in capsys.readouterr().err
    (result,) = json.loads(path.read_text())["dtypes"]
    assert result["baselines"] == {}


def test_vllm_is_sized_for_the_longest_request():
    runs = [Run("grounded", 1, [[1] * 10, [1] * 30], max_tokens=8, ignore_eos=False),
            Run("grounded", 2, [[1] * 20], max_tokens=8, ignore_eos=False)]
    assert max_model_len(runs) == 38

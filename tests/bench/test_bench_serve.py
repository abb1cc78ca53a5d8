"""`kvpool bench serve`: the workload is seeded and Poisson-timed, the statistics are computed
exactly, and a short run against its own in-process server reports every figure."""

from __future__ import annotations

import json
import math

import pytest

from kvpool.bench.serve import RequestResult, ServeWorkload, summarize
from kvpool.cli import main

TINY = ["--model", "tiny", "--load-format", "dummy", "--num-gpu-blocks", "64",
        "--no-enable-warmup"]


def test_workload_is_seeded_and_poisson_timed() -> None:
    workload = ServeWorkload(num_prompts=50, input_len=(3, 9), output_len=(2, 4),
                             request_rate=20.0, seed=3)
    requests = workload.requests(vocab_size=512)
    assert requests == workload.requests(vocab_size=512)
    arrivals = [arrival for arrival, _, _ in requests]
    assert arrivals[0] == 0 and arrivals == sorted(arrivals) and arrivals[-1] > 0
    assert all(3 <= len(prompt) <= 9 and max(prompt) < 512 for _, prompt, _ in requests)
    assert all(2 <= output_len <= 4 for _, _, output_len in requests)
    at_once = ServeWorkload(num_prompts=5).requests(vocab_size=512)
    assert {arrival for arrival, _, _ in at_once} == {0.0}
    with pytest.raises(ValueError, match="must be positive"):
        ServeWorkload(request_rate=0)


def test_summary_statistics_are_exact() -> None:
    results = [
        RequestResult(prompt_len=4, output_len=3, ttft=0.1, latency=0.5, itls=[0.2, 0.2]),
        RequestResult(prompt_len=6, output_len=5, ttft=0.3, latency=1.1, itls=[0.2] * 4),
        RequestResult(prompt_len=8, error="HTTP 503"),
    ]
    summary = summarize(results, duration=2.0)
    assert (summary["num_completed"], summary["num_failed"]) == (2, 1)
    assert summary["output_tokens_per_s"] == 4.0
    assert summary["total_tokens_per_s"] == 9.0
    assert summary["request_throughput"] == 1.0
    assert math.isclose(summary["ttft_ms_mean"], 200.0)
    assert math.isclose(summary["ttft_ms_p50"], 200.0)
    assert math.isclose(summary["tpot_ms_mean"], 200.0)
    assert math.isclose(summary["itl_ms_p99"], 200.0)
    assert math.isclose(summary["e2e_ms_mean"], 800.0)


def test_short_run_against_its_own_server(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", *TINY, "--num-prompts", "6", "--input-len", "4", "12",
            "--output-len", "3", "6", "--request-rate", "200", "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    workload = ServeWorkload(num_prompts=6, input_len=(4, 12), output_len=(3, 6),
                             request_rate=200)
    expected_output = sum(output_len for _, _, output_len in workload.requests(512))
    assert (result["num_completed"], result["num_failed"]) == (6, 0)
    assert round(result["output_tokens_per_s"] * result["duration_s"]) == expected_output
    for key in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "itl_ms_p99", "e2e_ms_mean"):
        assert result[key] > 0
    assert result["workload"]["request_rate"] == 200


def test_table_lists_every_latency(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", *TINY, "--num-prompts", "3", "--input-len", "4", "4",
            "--output-len", "2", "2", "--max-concurrency", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "requests: 3 completed, 0 failed" in out
    for label in ("TTFT", "TPOT", "ITL", "E2E", "output tok/s"):
        assert label in out

"""`kvpool bench throughput` runs its workload through kvpool and transformers and reports JSON."""

from __future__ import annotations

import json

from kvpool.bench.throughput import Workload
from kvpool.cli import main


def test_workload_is_seeded_and_shares_the_prefix():
    workload = Workload(num_prompts=3, input_len=(4, 9), output_len=(2, 5), shared_prefix=6)
    first, again = workload.requests(1000), workload.requests(1000)
    assert first == again
    assert all(prompt[:6] == first[0][0][:6] for prompt, _ in first)
    assert all(10 <= len(prompt) <= 15 and 2 <= out <= 5 for prompt, out in first)


def test_throughput_json_against_the_transformers_baseline(capsys):
    argv = [
        "bench", "throughput", "--json", "--model", "tiny", "--load-format", "dummy",
        "--num-prompts", "5", "--input-len", "4", "12", "--output-len", "2", "6",
        "--baseline", "hf", "--baseline-batch-size", "2", "--kv-cache-memory", "4MiB",
    ]  # fmt: skip
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    keys = {
        "requests_per_s", "output_tokens_per_s", "total_tokens_per_s", "peak_blocks_used",
        "num_preemptions", "baseline_output_tokens_per_s", "speedup",
    }  # fmt: skip
    assert keys <= set(result)
    assert result["num_output_tokens"] == sum(
        out for _, out in Workload(5, (4, 12), (2, 6)).requests(512)
    )
    assert result["peak_blocks_used"] > 0 and result["speedup"] > 0
    assert 0 < result["decode_only_model_seconds"] < result["step_phase_seconds"]["model"]


def test_throughput_table_splits_model_time_into_prefill_and_decode(capsys):
    argv = [
        "bench", "throughput", "--model", "tiny", "--load-format", "dummy",
        "--num-prompts", "3", "--input-len", "4", "12", "--output-len", "4", "6",
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "output tokens / s" in table
    assert "in steps with prefill chunks" in table and "in decode-only steps" in table

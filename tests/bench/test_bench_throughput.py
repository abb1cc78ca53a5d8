"""`kvpool bench throughput` runs its workload through kvpool and its baselines and reports."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.roofline import workload_flops
from kvpool.bench.throughput import Workload
from kvpool.bench.vllm_baseline import compare_tokens, vllm_kv_cache_gib
from kvpool.cli import main
from kvpool.model.config import ModelConfig
from kvpool.model.flops import layer_weights

TINY = ["--model", "tiny", "--load-format", "dummy", "--dtype", "float32"]


def test_workload_is_seeded_and_shares_the_prefix():
    workload = Workload(num_prompts=3, input_len=(4, 9), output_len=(2, 5), shared_prefix=6)
    first, again = workload.requests(1000), workload.requests(1000)
    assert first == again
    assert all(prompt[:6] == first[0][0][:6] for prompt, _ in first)
    assert all(10 <= len(prompt) <= 15 and 2 <= out <= 5 for prompt, out in first)


def test_throughput_json_runs_each_prefix_of_the_workload_against_transformers(capsys):
    argv = [
        "bench", "throughput", "--json", *TINY, "--num-prompts", "5", "2",
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


def test_throughput_table_names_each_run_and_splits_model_time(capsys):
    argv = [
        "bench", "throughput", *TINY, "--num-prompts", "3", "--input-len", "4", "12",
        "--output-len", "4", "6", "--latency-tokens", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "kvpool output tok/s" in table and "single-request decode, ms/token" in table
    assert "in steps with prefill chunks" in table and "in decode-only steps" in table


# The lead adds swap once the engine wires it, e.g.
# (["recompute", "swap"], ["--swap-space", "0.01"]).
@pytest.mark.parametrize("modes, tier_flags", [(["recompute"], [])])
def test_throughput_repeats_every_run_per_preemption_mode(modes, tier_flags, tmp_path, capsys):
    path = tmp_path / "report.json"
    argv = [
        "bench", "throughput", *TINY, "--num-prompts", "6", "--input-len", "4", "12",
        "--output-len", "20", "30", "--latency-tokens", "2", "--num-gpu-blocks", "8",
        "--preemption-modes", *modes, *tier_flags, "--output-json", str(path),
    ]  # fmt: skip  8 blocks of 16 tokens hold 3 of the 6 requests: preemptions
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "preemption modes" in table and "over recompute" in table
    report = json.loads(path.read_text())
    assert report["preemption_modes"] == modes
    assert [result["preemption_mode"] for result in report["dtypes"]] == modes
    for result in report["dtypes"]:
        run = result["kvpool"]["runs"]["6"]
        assert run["num_preemptions"] > 0
        assert run["num_preemptions"] == (run["num_recompute_preemptions"]
                                          + run["num_swap_preemptions"])
        assert set(run["cached_tokens_by_tier"]) <= {"device", "host", "disk", "shared"}
        if result["preemption_mode"] == "recompute":
            assert run["num_swap_preemptions"] == run["num_swapped_out_bytes"] == 0
            assert result["comparison"]["6"]["over_recompute"] == 1.0
        else:
            assert result["comparison"]["6"]["over_recompute"] > 0


def test_swap_without_a_host_tier_fails_before_running_anything(capsys):
    argv = ["bench", "throughput", *TINY, "--preemption-modes", "recompute", "swap"]
    assert main(argv) == 2  # the config's ValueError, in one line
    assert capsys.readouterr().out == ""


def test_the_vllm_baseline_without_its_venv_fails_before_running_anything(tmp_path, capsys):
    missing = tmp_path / "no-venv" / "python"
    argv = ["bench", "throughput", "--baseline", "vllm", "--vllm-python", str(missing)]
    with pytest.raises(SystemExit, match="make vllm-venv"):
        main(argv)
    assert capsys.readouterr().out == ""  # nothing was measured, so nothing was lost


def test_the_vllm_baseline_needs_real_weights(tmp_path):
    argv = ["bench", "throughput", "--baseline", "vllm", *TINY]
    with pytest.raises(SystemExit, match="real weights"):
        main(argv)


def test_token_comparison_finds_the_first_divergence():
    ours = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert compare_tokens(ours, ours) == {
        "identical_requests": 3, "num_requests": 3, "first_divergence": None}
    theirs = [[1, 2, 3], [4, 9, 6], [7]]
    assert compare_tokens(ours, theirs) == {
        "identical_requests": 1, "num_requests": 3, "first_divergence": (1, 1)}


def test_vllm_gets_kvpools_kv_budget_in_whole_gib_rounded_up():
    gib = 1024**3
    assert [vllm_kv_cache_gib(n) for n in (1, gib, gib + 1, 2 * gib - 4096)] == [1, 1, 2, 2]


def test_model_flops_count_projections_attention_and_lm_head():
    config = ModelConfig(architecture="llama", vocab_size=10, hidden_size=4,
                         intermediate_size=6, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=2)
    assert layer_weights(config) == 4 * 2 * (2 * 2 + 2 * 1) + 3 * 4 * 6
    # prompt 3, output 2: 4 tokens fed (positions 0..3 attend to 1..4 keys), 2 LM-head rows
    expected = (4 * 2 * 2 * layer_weights(config) + (1 + 2 + 3 + 4) * 4 * 2 * 2 * 2
                + 2 * 2 * 10 * 4)
    assert workload_flops(config, [(3, 2)]) == expected
    # 2 prompt tokens from the prefix cache: positions 0 and 1 (1 + 2 keys) are not computed
    saved = 2 * 2 * 2 * layer_weights(config) + (1 + 2) * 4 * 2 * 2 * 2
    assert workload_flops(config, [(3, 2)], cached_tokens=[2]) == expected - saved

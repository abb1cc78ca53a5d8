"""`kvpool bench throughput` runs its workload through kvpool and reports (its baselines:
tests/benchmarks/test_throughput_baselines.py)."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.roofline import workload_flops
from kvpool.bench.throughput import Workload, compare_tokens
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


def test_token_comparison_finds_the_first_divergence():
    ours = [[1, 2, 3], [4, 5, 6], [7, 8]]
    assert compare_tokens(ours, ours) == {
        "identical_requests": 3, "num_requests": 3, "first_divergence": None}
    theirs = [[1, 2, 3], [4, 9, 6], [7]]
    assert compare_tokens(ours, theirs) == {
        "identical_requests": 1, "num_requests": 3, "first_divergence": (1, 1)}


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


def test_the_user_command_has_no_baselines(capsys):
    # Baselines are a development benchmark (python -m benchmarks.throughput_baselines).
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "throughput", "--baseline", "hf"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --baseline" in capsys.readouterr().err

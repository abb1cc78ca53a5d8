"""`kvpool bench multi-turn` runs closed-loop conversations per KV-tier configuration and
reports TTFT, throughput and what each tier served."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.multi_turn import Conversations
from kvpool.cli import main

TINY = ["--model", "tiny", "--load-format", "dummy", "--dtype", "float32"]
SHORT = ["--num-conversations", "2", "--num-turns", "2", "--system-prompt-len", "40",
         "--user-len", "8", "--output-len", "4", "--kv-cache-memory", "4MiB"]


def test_conversations_are_seeded_and_share_the_system_prompt():
    workload = Conversations(num_conversations=3, num_turns=2, system_prompt_len=5, user_len=4)
    system, users = workload.user_tokens(1000)
    assert (system, users) == workload.user_tokens(1000)
    assert len(system) == 5 and all(100 <= token < 1000 for token in system)
    assert [[len(turn) for turn in turns] for turns in users] == [[4, 4]] * 3
    assert workload.max_total_tokens == 5 + 2 * (4 + 64)


# The lead adds tiered configurations here once the engine wires them (e.g. ["off", "host"]).
@pytest.mark.parametrize("tiers", [["off"]])
def test_multi_turn_json_reports_every_turn_of_every_configuration(tiers, tmp_path, capsys):
    path = tmp_path / "report.json"
    argv = ["bench", "multi-turn", "--json", *TINY, *SHORT, "--tiers", *tiers,
            "--no-warmup-pass", "--output-json", str(path)]  # the table test warms up
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert json.loads(path.read_text()) == report and report["warmup_pass"] is False
    assert list(report["tiers"]) == tiers and report["outputs_identical"] is True
    for tier in tiers:
        result = report["tiers"][tier]
        assert result["num_turns"] == 4 and result["num_output_tokens"] == 4 * 4
        assert result["output_tokens_per_s"] > 0 and result["elapsed_s"] > 0
        assert 0 < result["ttft_ms"]["p50"] <= result["ttft_ms"]["p99"]
        assert result["ttft_ms_turns_2_plus"]["p50"] > 0
        # turn 1: 40 + 8 tokens; turn 2: 48 + 4 output + 8 more
        assert result["num_prompt_tokens"] == 2 * (48 + 60)
        # each second turn finds its first turn's 48 prompt tokens (3 blocks) cached
        assert 2 * 48 <= result["num_cached_prompt_tokens"] < result["num_prompt_tokens"]
        assert set(result["cached_tokens_by_tier"]) <= {"device", "host", "disk", "shared"}
        assert result["num_preemptions"] == (result["num_recompute_preemptions"]
                                             + result["num_swap_preemptions"])
        assert ("ttft_vs_off" in result) == (tier != "off")


def test_multi_turn_table_names_each_configuration(capsys):
    assert main(["bench", "multi-turn", *TINY, *SHORT, "--tiers", "off"]) == 0
    table = capsys.readouterr().out
    assert "TTFT p50/p99 ms" in table and "served by device/host/disk" in table
    assert "greedy outputs identical across configurations: yes" in table


def test_a_pool_too_small_for_the_last_turn_fails_before_measuring():
    argv = ["bench", "multi-turn", *TINY, *SHORT, "--tiers", "off", "--num-gpu-blocks", "2"]
    with pytest.raises(SystemExit, match="raise --kv-cache-memory"):
        main(argv)


def test_every_tier_serves_turns_on_a_pool_too_small_for_the_histories(capsys):
    """A device pool that cannot keep the histories: the host and disk tiers serve them, the
    restarted engine finds even the first turns on disk, and greedy outputs do not change."""
    argv = ["bench", "multi-turn", "--json", *TINY, "--num-conversations", "4", "--num-turns",
            "3", "--system-prompt-len", "200", "--user-len", "16", "--output-len", "4",
            "--kv-cache-memory", "160KiB", "--swap-space", "0.001", "--no-warmup-pass"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(report["tiers"]) == ["off", "host", "disk", "host+disk", "disk-restart"]
    assert report["outputs_identical"] is True
    served = {tier: result["cached_tokens_by_tier"] for tier, result in report["tiers"].items()}
    assert served["off"]["host"] == served["off"]["disk"] == 0
    assert served["host"]["host"] > 0 and served["disk"]["disk"] > 0
    restart = report["tiers"]["disk-restart"]
    assert served["disk-restart"]["disk"] > served["disk"]["disk"]  # the first turns too
    assert restart["num_cached_prompt_tokens"] > report["tiers"]["disk"]["num_cached_prompt_tokens"]


def test_a_restart_needs_the_disk_run_before_it():
    with pytest.raises(SystemExit, match="list disk first"):
        main(["bench", "multi-turn", *TINY, *SHORT, "--tiers", "disk-restart", "disk"])

"""`kvpool bench blocks` runs end to end and reports every figure (values, never timing)."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.blocks import BlocksBenchConfig, Measurement
from kvpool.cli import main

REQUIRED_KEYS = ("alloc_free_pairs_per_s", "append_tokens_per_s", "prefix_lookup_4096_ms")


def test_json_has_every_key_with_a_positive_value(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "blocks", "--json", "--quick"]) == 0
    result = json.loads(capsys.readouterr().out)
    for key in REQUIRED_KEYS:
        assert result[key] > 0
        assert result[f"{key}_median"] > 0
    assert result["alloc_free_batched_blocks_per_s"] > 0
    assert set(result["targets"]) == {"alloc_free_pairs_per_s", "prefix_lookup_4096_ms"}
    assert result["config"]["num_repeats"] == 2


def test_table_lists_every_measurement(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "blocks", "--quick", "--repeats", "1", "--block-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "block_size 8, 1 repeats" in out
    for label in ("alloc+free pairs / s", "append tokens / s", "prefix lookup, 4096 tokens (ms)"):
        assert label in out


def test_best_is_max_for_rates_and_min_for_latencies() -> None:
    rate = Measurement("r", "rate", (1.0, 3.0, 2.0), higher_is_better=True, target=2.5)
    latency = Measurement("l", "latency", (1.0, 3.0, 2.0), higher_is_better=False, target=0.5)
    assert (rate.best, rate.median, rate.is_target_met) == (3.0, 2.0, True)
    assert (latency.best, latency.median, latency.is_target_met) == (1.0, 2.0, False)


def test_config_rejects_non_positive_values() -> None:
    with pytest.raises(ValueError, match="num_repeats must be >= 1"):
        BlocksBenchConfig(num_repeats=0)

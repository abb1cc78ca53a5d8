"""`kvpool bench kv-capacity`: the pool really allocated per KV dtype, and the issue's targets
(int8 holds at least 3.5x the tokens of float32 and 1.75x those of bfloat16) on SmolLM2."""

from __future__ import annotations

import json

from kvpool.cli import main


def test_capacity_per_kv_dtype_within_one_budget(capsys) -> None:
    assert main(["bench", "kv-capacity", "--kv-cache-memory", "64MiB", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rows = result["kv_cache_dtypes"]
    assert set(rows) == {"float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2"}
    for row in rows.values():
        assert row["allocated_bytes"] <= 64 * 2**20
        assert row["num_tokens"] == row["num_blocks"] * 16
        # Whole blocks: one more would not have fit (the null block is a row too).
        assert (row["num_blocks"] + 2) * row["bytes_per_block"] > 64 * 2**20
    int8 = rows["int8"]
    assert int8["tokens_over_float32"] >= 3.5 and int8["tokens_over_bfloat16"] >= 1.75
    assert int8["scale_bytes_per_token"] == 30 * 2 * 3 * 4  # SmolLM2: 30 layers, 3 KV heads
    assert rows["fp8_e4m3"]["num_tokens"] == rows["fp8_e5m2"]["num_tokens"] == int8["num_tokens"]


def test_capacity_table_is_readable(capsys) -> None:
    assert main(["bench", "kv-capacity", "--kv-cache-memory", "16MiB"]) == 0
    out = capsys.readouterr().out
    assert "KV capacity of 16 MiB" in out and "int8" in out and "4.00×" in out

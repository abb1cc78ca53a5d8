"""`python -m benchmarks.vllm_kv_capacity`'s kvpool side: reading vLLM's start-up capacity
lines, the model directory it hands vLLM, and the table. vLLM itself runs in its own venv and
is not needed here."""

from __future__ import annotations

import json

from benchmarks.vllm_kv_capacity import format_table, parse_capacity_log, write_model_directory

# vLLM 0.32.0's CPU build, gemma-3-1b, 1 GiB, max_model_len 4096, hybrid manager on.
LOG = """\
(MainProcess pid=1) INFO 12-06 15:13:36 [cpu_worker.py:260] Explicitly set (1.0/23.54) GiB for KV cache on node 0.
(MainProcess pid=1) WARNING 12-06 15:13:36 [kv_cache_utils.py:1483] Add 2 padding layers, may waste at most 9.09% KV cache memory
(MainProcess pid=1) INFO 12-06 15:13:36 [kv_cache_utils.py:2327] CPU KV cache size: 36,472 tokens, Maximum concurrency for 4,096 tokens per request: 8.90x
"""  # noqa: E501


def test_the_capacity_and_padding_lines_are_read():
    assert parse_capacity_log(LOG) == {
        "kv_cache_size_tokens": 36472, "max_model_len": 4096, "max_concurrency": 8.9,
        "padding_layers": 2, "padding_waste_percent": 9.09}


def test_a_log_without_the_lines_reads_as_none_and_no_padding():
    assert parse_capacity_log("GPU KV cache size: 1,024 tokens") == {
        "kv_cache_size_tokens": None, "max_model_len": None, "max_concurrency": None,
        "padding_layers": 0, "padding_waste_percent": 0.0}
    line = "GPU KV cache size: 1,024 tokens, Maximum concurrency for 512 tokens per request: 2.00x"
    assert parse_capacity_log(line)["kv_cache_size_tokens"] == 1024


def test_the_model_directory_is_the_presets_config_with_vllms_architecture(tmp_path):
    directory = write_model_directory("gemma-3-1b", "bfloat16", tmp_path / "gemma")
    fields = json.loads((directory / "config.json").read_text())
    assert fields["architectures"] == ["Gemma3ForCausalLM"]
    assert fields["torch_dtype"] == "bfloat16"
    assert (fields["num_hidden_layers"], fields["num_key_value_heads"], fields["head_dim"],
            fields["sliding_window"], fields["sliding_window_pattern"]) == (26, 1, 256, 512, 6)


def _group(kind: str, layers: int, window: int | None, blocks: int) -> dict:
    return {"kind": kind, "num_layers": layers, "block_size": 128, "page_size_bytes": 131072,
            "sliding_window": window, "blocks_per_request": blocks}


def test_the_table_has_one_row_per_run_with_the_groups_counted():
    log = {"padding_layers": 2}
    hybrid = {"max_model_len": 4096, "hybrid": True, "num_blocks": 2048, "block_size": 128,
              "kv_cache_size_tokens": 36472, "max_concurrency": 8.9043,
              "max_num_batched_tokens": 4096, "log": log,
              "groups": [*[_group("SlidingWindowSpec", 4, 512, 33)] * 4,
                         *[_group("SlidingWindowSpec", 3, 512, 33)] * 2,
                         _group("FullAttentionSpec", 4, None, 32)]}
    single = {**hybrid, "hybrid": False, "num_blocks": 315, "kv_cache_size_tokens": 40320,
              "max_concurrency": 9.84375, "log": {"padding_layers": 0},
              "groups": [_group("FullAttentionSpec", 26, 512, 32)]}
    report = {"vllm_version": "0.32.0", "preset": "gemma-3-1b", "dtype": "bfloat16",
              "kv_cache_gib": 1, "runs": [hybrid, single]}
    rows = format_table(report).splitlines()[-2:]
    assert rows[0] == ("| 4096 | on | 2048 x 128 | 36,472 | 8.90x | 4 sliding(512) x4 + "
                       "2 sliding(512) x3 + 1 full x4 | 230 | 2 | 4096 |")
    assert rows[1] == "| 4096 | off | 315 x 128 | 40,320 | 9.84x | 1 full x26 | 32 | 0 | 4096 |"

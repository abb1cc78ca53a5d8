"""`kvpool bench disagg`: the workload is seeded and its long prompts share no prefix, the
projection's arithmetic is exact, and one tiny run of both configurations (the random-weight
`tiny` preset, real processes) reports every figure, consistent with the workload it sent:
the handover's counters from the decode worker's /metrics included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.bench.disagg_transfer import fit_handover, project
from kvpool.bench.disagg_workload import MixedWorkload
from kvpool.cli import main

BLOCK_SIZE = 16  # kvpool serve's default
WORKLOAD = MixedWorkload(num_chats=2, chat_len=(20, 40), chat_output_len=6, num_long=2,
                         long_len=120, long_output_len=4, long_interval=0.3)
ARGV = ["bench", "disagg", "--model", "tiny", "--load-format", "dummy",
        "--serve-args=--num-gpu-blocks 256 --no-enable-warmup",
        "--num-chats", "2", "--chat-len", "20", "40", "--chat-output-len", "6",
        "--num-long", "2", "--long-len", "120", "--long-output-len", "4",
        "--long-interval", "0.3", "--probe-repeats", "1", "--json"]


def test_the_workload_is_seeded_and_long_prompts_share_no_prefix() -> None:
    source = list(range(10, 500))
    prompts = WORKLOAD.long_prompts(source)
    assert prompts == WORKLOAD.long_prompts(source)
    assert [len(prompt) for prompt in prompts] == [120, 120]
    assert prompts[0][0] != prompts[1][0]  # each window starts at its own offset
    chat = WORKLOAD.chat_prompts(source, 0)
    lengths = [len(next(chat)) for _ in range(20)]
    assert all(20 <= length <= 40 for length in lengths) and len(set(lengths)) > 1
    assert next(WORKLOAD.chat_prompts(source, 1)) != next(WORKLOAD.chat_prompts(source, 0))
    with pytest.raises(ValueError, match="at least 1"):
        MixedWorkload(num_long=0)


def test_the_projection_adds_fixed_checksum_and_wire_costs() -> None:
    fit = fit_handover([(2, 0.012), (10, 0.020), (10, 0.020)])
    assert fit == pytest.approx({"fixed_ms": 10.0, "ms_per_block": 1.0})
    # 1 MB blocks, CRC-32 at 1 GB/s (2 ms/block, both sides), 8 Gb/s = 1 ms/block on the wire.
    projection = project(fit, 1e6, 64, 1e9, 8.0, measured_long_ms=74.0)
    assert projection["measured"] is False
    assert projection["checksum_ms_per_block"] == pytest.approx(2.0)
    assert projection["rdma_ms_per_block"] == pytest.approx(1.0)
    assert projection["rdma_long_ms"] == pytest.approx(10 + 64 * 3)
    assert projection["rdma_long_ms_without_checksums"] == pytest.approx(10 + 64)
    assert projection["loopback_over_rdma"] == pytest.approx(74 / 202)
    assert project(None, None, 64, 1e9, 8.0, None)["rdma_long_ms"] is None


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    plot = tmp_path_factory.mktemp("disagg") / "itl.png"
    output = plot.with_name("disagg.json")
    assert main([*ARGV, "--plot", str(plot), "--output-json", str(output)]) == 0
    return json.loads(output.read_text()), plot


def test_both_configurations_serve_the_whole_workload(tiny_run) -> None:
    body, plot = tiny_run
    assert body["workload"]["num_long"] == 2
    assert list(body["configs"]) == ["colocated", "disagg"]
    for row in body["configs"].values():
        assert (row["num_long_requests"], row["num_failed"]) == (2, 0)
        assert row["num_chat_requests"] >= 2  # every chat sent at least one
        assert row["num_output_tokens"] == 6 * row["num_chat_requests"] + 4 * 2
        for key in ("chat_itl_ms_p50", "chat_itl_ms_p99", "chat_ttft_ms_p50",
                    "chat_ttft_ms_p99", "long_ttft_ms_p50", "long_ttft_ms_p99",
                    "output_tokens_per_s"):
            assert row[key] > 0, key
    # Disaggregated, a long prompt's decode loads its full blocks before its last token.
    assert body["configs"]["disagg"]["long_cached_blocks_p50"] == (120 - 1) // BLOCK_SIZE
    assert body["configs"]["colocated"]["long_cached_blocks_p50"] == 0
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_the_handover_figures_match_the_workload(tiny_run) -> None:
    body, _ = tiny_run
    disagg, projection = body["configs"]["disagg"], body["projection"]
    assert projection["measured"] is False and projection["rdma_gbps"] == 100.0
    assert projection["blocks_per_long_prompt"] == (120 - 1) // BLOCK_SIZE
    transfer = disagg["transfer"]
    num_requests = disagg["num_chat_requests"] + disagg["num_long_requests"]
    assert transfer["blocks_received"] >= 2 * ((120 - 1) // BLOCK_SIZE)
    assert 0 < transfer["num_loads"] <= num_requests
    assert transfer["bytes_received"] == transfer["bytes_per_block"] * transfer["blocks_received"]
    assert transfer["failures"] == {}
    probe = disagg["probe"]
    assert probe["long"] == [[(120 - 1) // BLOCK_SIZE, pytest.approx(probe["long"][0][1])]]
    assert probe["chat"][0][0] == (40 - 1) // BLOCK_SIZE
    assert set(probe["fit"]) == {"fixed_ms", "ms_per_block"}
    for key in ("fixed_ms", "checksum_ms_per_block", "rdma_ms_per_block", "rdma_long_ms",
                "measured_loopback_long_ms", "loopback_over_rdma"):
        assert projection[key] is not None, key

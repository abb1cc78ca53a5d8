"""`kvpool bench tp`: the paper estimate follows its formulas, the analytic collective bytes,
the step summary, and the CLI's `--estimate-only --json` (no engine, no process group)."""

from __future__ import annotations

import json

import pytest
import torch

from kvpool.bench import tp_estimate
from kvpool.bench.tensor_parallel import StepRecord, expected_step, summarize_steps
from kvpool.bench.tp_estimate import H200, LLAMA_2_70B, decode_step_estimate
from kvpool.cli import main
from kvpool.model import presets

LLAMA_3_8B = presets.preset("llama-3-8b")


def test_doubling_tp_halves_the_weight_bytes_per_gpu():
    by_tp = {tp: decode_step_estimate(LLAMA_2_70B, tp, batch=64, context=2048)
             for tp in (1, 2, 4, 8)}
    for tp in (2, 4, 8):
        assert by_tp[tp]["weight_bytes_per_gpu"] == by_tp[tp // 2]["weight_bytes_per_gpu"] / 2
        assert by_tp[tp]["kv_bytes_per_gpu"] == by_tp[tp // 2]["kv_bytes_per_gpu"] / 2
    # 70B in bf16 does not fit one 141 GB GPU with a batch of 64 x 2k context; it fits on two.
    assert not by_tp[1]["fits"] and by_tp[2]["fits"]


def test_kv_bytes_stop_shrinking_once_kv_heads_are_replicated():
    tiny = presets.preset("tiny")  # 2 KV heads: at tp 4 each KV head lives on 2 ranks
    at = {tp: decode_step_estimate(tiny, tp, batch=4, context=64)["kv_bytes_per_gpu"]
          for tp in (1, 2, 4)}
    assert at[2] == at[1] / 2 and at[4] == at[2]


def test_one_gpu_has_no_collective_time():
    row = decode_step_estimate(LLAMA_3_8B, 1, batch=64, context=2048)
    assert row["num_collectives"] == 0 and row["collective_ms"] == 0.0
    assert row["collective_share"] == 0.0 and row["step_ms"] == row["hbm_ms"]


def test_collective_time_follows_the_ring_formula():
    batch, tp = 64, 4
    row = decode_step_estimate(LLAMA_3_8B, tp, batch=batch, context=2048)
    message = batch * LLAMA_3_8B.hidden_size * 2  # bf16
    assert row["all_reduce_message_bytes"] == message
    one = 2 * (tp - 1) / tp * message / H200.bus_bytes_per_s + H200.collective_latency_s
    assert row["all_reduce_ms"] == pytest.approx((2 * LLAMA_3_8B.num_layers + 1) * one * 1e3)
    gather = (tp - 1) / tp * batch * LLAMA_3_8B.vocab_size * 2 / H200.bus_bytes_per_s
    assert row["gather_ms"] == pytest.approx((gather + H200.collective_latency_s) * 1e3)
    assert row["num_collectives"] == 2 * LLAMA_3_8B.num_layers + 2
    assert row["collective_share"] == pytest.approx(
        row["collective_ms"] / (row["hbm_ms"] + row["collective_ms"]))


def test_hbm_time_is_bytes_over_bandwidth():
    row = decode_step_estimate(LLAMA_3_8B, 2, batch=1, context=2048)
    total = row["weight_bytes_per_gpu"] + row["kv_bytes_per_gpu"]
    assert row["hbm_ms"] == pytest.approx(total / 4.8e12 * 1e3)


def test_a_tp_size_that_does_not_split_the_model_is_refused():
    with pytest.raises(ValueError, match="num_heads"):
        decode_step_estimate(LLAMA_3_8B, 3, batch=1, context=16)


def test_expected_step_bytes():
    config = presets.preset("smollm2-135m")
    calls, nbytes = expected_step(config, 3, num_tokens=5, num_logits_rows=2, element_size=4)
    all_reduce = (2 * config.num_layers + 1) * 5 * config.hidden_size * 4
    assert (calls, nbytes) == (2 * config.num_layers + 2, all_reduce + 2 * config.vocab_size
                               // 3 * 4)
    # A prefill chunk that samples nothing gathers nothing; one rank communicates nothing.
    assert expected_step(config, 2, 7, 0, 4) == (2 * config.num_layers + 1,
                                                 (2 * config.num_layers + 1) * 7 * 576 * 4)
    assert expected_step(config, 1, 7, 1, 4) == (0, 0)
    # Overlapped pieces: more calls for the same bytes, and no split below two rows a piece.
    layers, hidden, vocab = config.num_layers, config.hidden_size, config.vocab_size
    same_bytes = (2 * layers + 1) * 8 * hidden * 4 + 2 * vocab // 3 * 4
    assert expected_step(config, 3, 8, 2, 4, overlap_chunks=4) == (2 * layers * 4 + 2,
                                                                   same_bytes)
    assert expected_step(config, 3, 7, 2, 4, overlap_chunks=4)[0] == 2 * layers + 2


def test_summarize_steps_splits_prefill_and_decode():
    config = presets.preset("tiny")
    calls, nbytes = expected_step(config, 2, 2, 2, 4)
    prefill_calls, prefill_bytes = expected_step(config, 2, 16, 2, 4)
    steps = [StepRecord(False, 16, 2, prefill_calls, prefill_bytes, 0.5, 2.0),
             StepRecord(True, 2, 2, calls, nbytes, 0.1, 1.0),
             StepRecord(True, 2, 2, calls, nbytes + 4, 0.1, 1.0)]
    summary = summarize_steps(steps, config, 2, 4)
    assert summary["prefill"]["num_steps"] == 1 and summary["prefill"]["matches_expected"]
    assert summary["prefill"]["collective_share"] == 0.25
    assert summary["decode"]["num_steps"] == 2 and summary["decode"]["calls_per_step"] == calls
    assert not summary["decode"]["matches_expected"]  # the second step moved 4 bytes too many
    assert summary["decode"]["collective_share"] == pytest.approx(0.1)


def test_cli_estimate_only_json(capsys):
    assert main(["bench", "tp", "--estimate-only", "--json", "--tp-sizes", "1", "2",
                 "--batches", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "measured" not in report
    rows = report["estimate"]["rows"]
    assert [(row["model"], row["tp_size"]) for row in rows] == [
        (name, tp) for name in tp_estimate.ESTIMATE_MODELS for tp in (1, 2)]
    assert report["estimate"]["hardware"]["hbm_bytes_per_s"] == 4.8e12


def test_cli_estimate_only_table(capsys):
    assert main(["bench", "tp", "--estimate-only"]) == 0
    out = capsys.readouterr().out
    assert "paper estimate" in out and "llama-2-70b" in out
    assert len([line for line in out.splitlines() if "llama" in line]) == 2 * 2 * 4


def test_weight_bytes_count_bf16():
    # The estimate's weights are the roofline's (one owner), in bf16.
    from kvpool.bench.roofline import weight_bytes_read_per_step

    row = decode_step_estimate(LLAMA_3_8B, 1, batch=1, context=1)
    assert row["weight_bytes_per_gpu"] == weight_bytes_read_per_step(LLAMA_3_8B, torch.bfloat16)


def test_measured_collectives_equal_the_analytic_expectation():
    # Two CPU ranks (gloo), tiny dummy model, 2 prompts x 4 tokens: rank 0's counted bytes and
    # calls equal the formula in every prefill and decode step.
    from kvpool.bench.tensor_parallel import measure
    from kvpool.bench.throughput import Workload
    from kvpool.engine.config import EngineConfig

    config = EngineConfig(model="tiny", load_format="dummy", dtype="float32",
                          kv_cache_memory=1 << 22)
    result = measure(config, 2, Workload(2, (16, 16), (4, 4)), num_rounds=1)
    steps = result["runs"][0]["steps"]
    summary = summarize_steps(steps, result["model_config"], 2, result["element_size"])
    assert set(summary) == {"decode", "prefill"}
    assert all(kind["matches_expected"] for kind in summary.values())
    assert summary["decode"]["calls_per_step"] == 2 * result["model_config"].num_layers + 2
    assert all(0 < step.collective_seconds < step.seconds for step in steps)

"""The GPU check's summary: targets pass, fail, or say nothing when their figure is missing;
results lines cut short by a kill are skipped; JUnit counts are read."""

from __future__ import annotations

import json

from benchmarks.gpu.results import ResultLog, read_records
from benchmarks.gpu.summary import check_targets, read_junit, summarize


def attention(batch: int, context: int, fraction: float) -> dict:
    return {"step": "attention", "record": "shape", "batch": batch, "context": context,
            "triton_fraction_of_read_bandwidth": fraction, "triton_us": 9.0, "sdpa_us": 10.0}


def variant(name: str, dtype: str, kv: str, passed: bool, fraction: float) -> dict:
    return {"step": "e2e", "record": "variant", "name": name, "dtype": dtype,
            "kv_cache_dtype": kv, "passed": passed, "match_fraction": fraction}


GOOD_TESTS = {"tests": 5, "failures": 0, "errors": 0, "skipped": 0, "failed": []}
RECORDS = [
    {"step": "tests", "record": "exit", "status": "ok"},
    attention(64, 2048, 0.85), attention(256, 8192, 0.90), attention(1, 8192, 0.10),
    {"step": "engine", "record": "batch", "batch": 64, "decode_step_over_bound": 1.4,
     "output_tok_per_s": 300.0},
    {"step": "engine", "record": "sampled", "passed": True},
    {"step": "hf", "record": "batch", "batch": 64, "output_tok_per_s": 100.0},
    variant("fp32_torch", "float32", "auto", True, 1.0),
    variant("fp32_triton", "float32", "auto", True, 1.0),
    variant("bf16_triton", "bfloat16", "auto", False, 0.5),
]


def test_targets_pass_and_fail():
    checks = check_targets(RECORDS, GOOD_TESTS)
    assert checks["tests_passed"]["passed"] is True
    # Batch 1 is below the attention target's shapes: the lowest that counts is 0.85.
    assert checks["attention_min_fraction_of_read_bandwidth"] == {
        "value": 0.85, "target": ">= 0.8", "passed": True}
    assert checks["decode_step_max_over_bound"] == {
        "value": 1.4, "target": "<= 1.3", "passed": False}
    assert checks["fp32_tokens_identical_to_cpu"]["passed"] is True
    assert checks["reduced_precision_tokens_close"] == {
        "value": 0.5, "variants": {"bf16_triton": False}, "passed": False}
    assert checks["sampled_decoding_on_device"]["passed"] is True
    assert checks["engine_over_transformers_output_tok_per_s"]["value"] == 3.0


def test_missing_figures_are_not_failures():
    checks = check_targets([], {})
    assert {name: check["passed"] for name, check in checks.items()
            if "passed" in check} == dict.fromkeys(
        ("tests_passed", "attention_min_fraction_of_read_bandwidth",
         "decode_step_max_over_bound", "fp32_tokens_identical_to_cpu",
         "reduced_precision_tokens_close", "sampled_decoding_on_device"), None)


def test_tests_stopped_at_their_limit_did_not_pass():
    records = [{"step": "tests", "record": "exit", "status": "timed_out"}]
    check = check_targets(records, GOOD_TESTS)["tests_passed"]
    assert check["passed"] is False and check["step_status"] == "timed_out"


def test_a_line_cut_short_is_skipped(tmp_path):
    log = ResultLog(tmp_path, "env")
    log.add("read_bandwidth", bytes_per_s=1.0)
    with (tmp_path / "results.jsonl").open("a") as file:
        file.write('{"step": "env", "record": "copy_ban')  # killed mid-write
    assert [r["record"] for r in read_records(tmp_path)] == ["read_bandwidth"]


def test_summary_is_written_from_whatever_exists(tmp_path):
    ResultLog(tmp_path, "env").add("read_bandwidth", bytes_per_s=2.0)
    summary = summarize(tmp_path)
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == json.loads(
        json.dumps(summary))
    assert summary["results"] == {"env": [{"record": "read_bandwidth", "bytes_per_s": 2.0}]}
    assert summary["tests"] == {} and summary["tp"] is None


def test_junit_counts_and_failed_names(tmp_path):
    xml = tmp_path / "tests.xml"
    xml.write_text('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
                   '<testcase classname="t" name="a"/><testcase classname="t" name="b">'
                   '<failure/></testcase></testsuite></testsuites>')
    assert read_junit(xml) == {"tests": 3, "failures": 1, "errors": 0, "skipped": 1,
                               "failed": ["t::b"]}
    assert read_junit(tmp_path / "missing.xml") == {}

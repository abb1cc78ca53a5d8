"""`kvpool bench structured` runs one batch per constrained fraction and reports tokens/s and
the ratio to the unconstrained run (a smoke test: a tiny batch, a few tokens)."""

from __future__ import annotations

import json

import pytest

from kvpool.bench.structured import format_structured, request_params
from kvpool.cli import main

pytestmark = pytest.mark.slow


def test_request_params_constrain_the_asked_share():
    params = request_params(4, 0.5, max_tokens=8, temperature=1.0)
    assert [p.structured_outputs is not None for p in params] == [True, True, False, False]
    assert all(p.ignore_eos and p.max_tokens == 8 for p in params)
    assert len({p.seed for p in params}) == 4


def test_structured_bench_json_reports_every_fraction_with_equal_work(capsys):
    argv = ["bench", "structured", "--json", "--num-prompts", "2", "--max-tokens", "3",
            "--rounds", "2", "--no-warmup", "--dtype", "float32",
            "--kv-cache-memory", "8MiB"]  # fmt: skip
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["num_rounds"] == 2 and list(report["fractions"]) == ["0", "0.5", "1"]
    for result in report["fractions"].values():
        assert result["num_output_tokens"] == 2 * 3  # nobody stops early
        assert len(result["output_tokens_per_s_runs"]) == 2
        assert result["output_tokens_per_s"] > 0 and result["over_unconstrained"] > 0
    assert report["fractions"]["0"]["over_unconstrained"] == 1.0
    table = format_structured(report)
    assert "vs 0%" in table and "100%" in table

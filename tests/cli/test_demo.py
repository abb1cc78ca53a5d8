"""`kvpool demo` generates real replies with a memory report; `--experiments` runs the seeds."""

from __future__ import annotations

import pytest

from kvpool.cli import main
from kvpool.cli.demo import DEMO_QUESTIONS
from kvpool.experiments import SEED_EXPERIMENTS


def test_demo_generates_replies_and_reports_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--max-tokens", "6"]) == 0
    out = capsys.readouterr().out
    for question in DEMO_QUESTIONS:
        assert f"> {question}" in out
    report = out.split("== memory report", 1)[1]
    for label in ("peak blocks used", "maximum concurrency", "prefix-cache hit rate",
                  "preemptions", "contiguous"):
        assert label in report
    # the shared system prompt is served from the prefix cache after the first request
    hit_rate = float(report.split("prefix-cache hit rate")[1].split("%")[0])
    assert hit_rate > 0


def test_demo_runs_every_experiment_and_reports_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--experiments"]) == 0
    out = capsys.readouterr().out
    for name in SEED_EXPERIMENTS:
        assert f"[kvpool.experiments.{name}]" in out
    assert "== memory report" in out
    report = out.split("== memory report", 1)[1].splitlines()
    rows = {line.split()[1]: line.split()[2:] for line in report if line[:1].isdigit()}
    assert set(rows) == {"refcount", "block_table", "fragmentation", "prefix_sharing"}
    # blocks, used, free, cached, ... at the end of each experiment
    assert rows["refcount"][:4] == ["16", "0", "16", "0"]
    assert rows["fragmentation"][:4] == ["100", "95", "5", "0"]
    assert rows["prefix_sharing"][:4] == ["32", "0", "23", "9"]

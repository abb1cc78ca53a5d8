"""`kvpool simulate` end to end on a small generated trace: JSON, plots, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.cli import main


def test_cli_json_smoke(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code = main(["simulate", "--num-requests", "20", "--budget", "128MiB", "--block-sizes",
                 "16,64", "--num-samples", "2", "--json", "--plot-dir", str(tmp_path)])
    assert code == 0
    results = json.loads(capsys.readouterr().out)
    assert [r["strategy"] for r in results] == [
        "contiguous-max", "contiguous-pow2", "contiguous-exact-first", "contiguous-exact-best",
        "contiguous-exact-worst", "contiguous-classes", "contiguous-exact-compact", "paged-16",
        "paged-64", "paged-16+fork",
    ]
    for key in ("token_state_fraction", "peak_concurrency", "mean_concurrency",
                "external_fragmentation", "steps", "internal_fragmentation"):
        assert all(key in r for r in results)
    paged = next(r for r in results if r["strategy"] == "paged-16")
    contiguous = next(r for r in results if r["strategy"] == "contiguous-max")
    assert paged["token_state_fraction"] > contiguous["token_state_fraction"]
    assert (tmp_path / "memory_composition.png").stat().st_size > 0
    assert (tmp_path / "concurrency.png").stat().st_size > 0


def test_cli_reports_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--trace", "jsonl"]) == 2
    assert "--trace-file" in capsys.readouterr().err


def test_cli_help_names_the_kv_trace(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    assert "--trace kv" in capsys.readouterr().out

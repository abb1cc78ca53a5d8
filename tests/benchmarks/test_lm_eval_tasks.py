"""The lm-eval tasks' committed data is what `benchmarks.lm_eval.make_data` makes, each row's
answer is the capital, and both task files read that data file (docs/lm_eval.md)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from benchmarks.lm_eval.make_data import CAPITALS, DATA_DIR, rows

TASKS = Path(__file__).resolve().parents[2] / "benchmarks" / "lm_eval" / "tasks"


def test_the_committed_data_is_the_scripts() -> None:
    lines = (DATA_DIR / "capitals.jsonl").read_text().splitlines()
    committed = [json.loads(line) for line in lines]
    assert committed == rows()
    assert len(committed) == 60
    for row, (country, capital) in zip(committed, CAPITALS, strict=True):
        assert (row["country"], row["capital"]) == (country, capital)
        assert row["choices"][row["answer"]] == capital and len(set(row["choices"])) == 4


def test_both_tasks_read_the_committed_data() -> None:
    for name, output_type in (("kvpool_capitals_mc", "multiple_choice"),
                              ("kvpool_capitals_gen", "generate_until")):
        task = yaml.safe_load((TASKS / f"{name}.yaml").read_text())
        assert (task["task"], task["output_type"]) == (name, output_type)
        assert task["dataset_kwargs"]["data_files"]["test"] == \
            "benchmarks/lm_eval/data/capitals.jsonl"

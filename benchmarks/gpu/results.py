"""The GPU check's one results file, `results.jsonl`: one JSON object a line, appended as
each measurement finishes.

Why lines and not one JSON per step: a step killed by its time limit keeps every line it has
written (each is flushed and synced before the next measurement starts), and the summary can
read whatever exists. Every record names its `step` and its `record` (what was measured);
`scripts/gpu_check.sh` appends one `record: "exit"` line per step with its exit status.

A killed writer can leave a last line cut short: readers skip lines that do not parse.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

RESULTS_FILE = "results.jsonl"


class ResultLog:
    """Appends one step's records to `results.jsonl`."""

    def __init__(self, out_dir: Path, step: str) -> None:
        self.path = out_dir / RESULTS_FILE
        self.step = step

    def add(self, record: str, **fields: object) -> dict:
        """Append `{"step", "record", **fields}` and make it durable before returning it."""
        entry = {"step": self.step, "record": record, **fields}
        line = json.dumps(entry, default=str)
        with self.path.open("a") as file:
            file.write(line + "\n")
            file.flush()
            os.fsync(file.fileno())
        print(line, flush=True)  # the log shows each figure as it comes
        return entry


def read_records(out_dir: Path) -> list[dict]:
    """Every whole record in `out_dir/results.jsonl`, in order (none if there is no file)."""
    return list(_parse(out_dir / RESULTS_FILE))


def _parse(path: Path) -> Iterator[dict]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return
    for line in lines:
        try:
            entry = json.loads(line)
        except ValueError:  # cut short by a kill
            continue
        if isinstance(entry, dict):
            yield entry


def records_of(records: list[dict], step: str, record: str | None = None) -> list[dict]:
    """The records of `step` (and of kind `record`, if given), in order."""
    return [r for r in records
            if r.get("step") == step and (record is None or r.get("record") == record)]


def last_value(records: list[dict], step: str, record: str, field: str) -> object | None:
    """`field` of the latest `step`/`record` record that has it (None if none does)."""
    found = [r[field] for r in records_of(records, step, record) if r.get(field) is not None]
    return found[-1] if found else None

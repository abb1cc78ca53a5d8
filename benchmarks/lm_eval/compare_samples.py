"""Compares two lm-eval runs of the kvpool tasks sample by sample (run with `--log_samples`):
the largest difference between the two runs' log-likelihoods of the same choice, how many
choices the two rank the same way, and how many generations are identical. Prints JSON.

    python benchmarks/lm_eval/compare_samples.py OUT_A OUT_B   # lm-eval's --output_path dirs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def load_samples(root: Path, task: str) -> dict[int, dict]:
    """doc_id -> sample record of `task`'s newest samples file under `root`."""
    files = sorted(root.rglob(f"samples_{task}_*.jsonl"))
    if not files:
        raise SystemExit(f"no samples of {task} under {root} (run lm_eval with --log_samples)")
    with files[-1].open() as lines:
        return {record["doc_id"]: record for record in map(json.loads, lines)}


def choice_logprobs(record: dict) -> list[float]:
    return [float(response[0][0]) for response in record["resps"]]


def compare_mc(a: dict[int, dict], b: dict[int, dict]) -> dict:
    diffs, same_pick = [], 0
    for doc_id, record in a.items():
        first, second = choice_logprobs(record), choice_logprobs(b[doc_id])
        diffs += [abs(x - y) for x, y in zip(first, second, strict=True)]
        same_pick += first.index(max(first)) == second.index(max(second))
    return {"choices": len(diffs), "max_abs_logprob_diff": max(diffs),
            "same_argmax_docs": same_pick, "docs": len(a)}


def compare_gen(a: dict[int, dict], b: dict[int, dict]) -> dict:
    same = sum(record["resps"] == b[doc_id]["resps"] for doc_id, record in a.items())
    return {"identical_generations": same, "docs": len(a)}


def main(first: str, second: str) -> None:
    roots = Path(first), Path(second)
    report = {
        "kvpool_capitals_mc": compare_mc(*(load_samples(r, "kvpool_capitals_mc") for r in roots)),
        "kvpool_capitals_gen": compare_gen(*(load_samples(r, "kvpool_capitals_gen")
                                             for r in roots)),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main(*sys.argv[1:3])

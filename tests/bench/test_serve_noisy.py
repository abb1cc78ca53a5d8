"""`kvpool bench serve --noisy-neighbour`: the noisy tenant's requests are as heavy as the
limits allow (exact sizes), and a tiny run reports the quiet tenant alone and beside it (no
timing is asserted)."""

from __future__ import annotations

import json
import random

import pytest

from kvpool.bench.serve_noisy import NOISY_KINDS, RATIO_KEYS, noisy_body
from kvpool.cli import main

TINY = ["--model", "tiny", "--load-format", "dummy", "--num-gpu-blocks", "64",
        "--no-enable-warmup"]


def test_noisy_requests_are_the_heaviest_valid_ones() -> None:
    rng = random.Random(0)
    prompt = noisy_body("prompt", 5265, 1000, 512, rng)
    assert len(prompt["prompt"]) == 5265
    schema = noisy_body("schema", None, 1000, 512, rng)["structured_outputs"]["json"]
    compact = len(json.dumps(schema, separators=(",", ":")))
    assert 1000 - 30 < compact <= 1000  # one more property would not fit
    bias = noisy_body("bias", None, 1000, 512, rng)["logit_bias"]
    assert len(bias) == 300 and all(10 <= int(key) < 512 for key in bias)
    regex = noisy_body("regex", None, 1000, 512, rng)
    assert regex["structured_outputs"] == {"regex": ".{0,100000}"}


def test_tiny_run_reports_both_phases(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--noisy-neighbour", *TINY, "--num-prompts", "4",
            "--input-len", "4", "8", "--output-len", "3", "4", "--noisy-concurrency", "2",
            "--json"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    for phase in ("alone", "noisy"):
        assert (result[phase]["num_completed"], result[phase]["num_failed"]) == (4, 0)
    assert set(result["ratios"]) == set(RATIO_KEYS)
    kinds = {key.split(":")[0] for key in result["noisy_requests"]}
    assert kinds <= set(NOISY_KINDS) and kinds
    assert result["noisy_concurrency"] == 2


def test_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "serve", "--noisy-neighbour", *TINY, "--num-prompts", "2",
            "--input-len", "4", "4", "--output-len", "2", "2", "--noisy-concurrency", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "quiet tenant: 2 requests alone, 2 beside the noisy tenant" in out
    for label in ("ttft p50", "ttft p99", "itl p50", "itl p99", "noisy tenant's requests"):
        assert label in out

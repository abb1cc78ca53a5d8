"""`kvpool bench precision`: divergence positions and perplexities, end to end on SmolLM2."""

from __future__ import annotations

import json
import math

import pytest
import torch

from kvpool.bench.precision import (
    QUICK_MAX_TOKENS,
    QUICK_NUM_PROMPTS,
    QUICK_TEXT_TOKENS,
    DtypeRun,
    compare,
    first_divergence,
    format_table,
)
from kvpool.cli import main


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: on the shared 2-core machine two make every small op wait."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


@pytest.mark.slow
def test_float32_against_itself_agrees_everywhere(capsys, one_torch_thread) -> None:
    argv = ["bench", "precision", "--quick", "--json", "--dtype", "float32"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert (result["reference_dtype"], result["dtype"]) == ("float32", "float32")
    assert result["max_tokens"] == QUICK_MAX_TOKENS
    assert len(result["prompts"]) == QUICK_NUM_PROMPTS
    assert all(entry["prompt"] and entry["first_divergence"] is None
               and entry["reference_top2_gap"] is None for entry in result["prompts"])
    assert result["median_reference_top2_gap_at_divergence"] is None
    assert (result["fraction_identical"], result["median_first_divergence"]) == (
        1.0, QUICK_MAX_TOKENS)
    ppl = result["perplexity"]
    assert ppl["num_tokens"] == QUICK_TEXT_TOKENS
    assert 1 < ppl["reference"] == ppl["candidate"] < 1000  # a real model on English prose
    assert ppl["relative_difference"] == 0 and ppl["within_target"]
    assert ppl["top1_agreement"] == 1.0 and ppl["mean_abs_logprob_difference"] == 0


def test_first_divergence() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 9, 3]) == 1
    assert first_divergence([7, 2], [1, 2]) == 0
    assert first_divergence([1, 2, 3], [1, 2]) == 2  # a shorter run differs where it ends


def test_compare_summarises_divergence_and_perplexity() -> None:
    gaps = [[0.5, 0.4, 0.03, 0.2], [1.0] * 4, [0.01, 2.0, 2.0, 2.0]]
    reference = DtypeRun("float32", "float32", [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]], gaps,
                         [-1.0, -2.0, -3.0], [0, 1, 2])
    candidate = DtypeRun("bfloat16", "bfloat16", [[1, 2, 9, 9], [5, 6, 7, 8], [2, 1, 1, 1]], gaps,
                         [-1.0, -2.0, -3.3], [0, 1, 5])
    result = compare(reference, candidate, ("a", "b", "c"), max_tokens=4)
    assert [entry["first_divergence"] for entry in result["prompts"]] == [2, None, 0]
    assert [entry["reference_top2_gap"] for entry in result["prompts"]] == [0.03, None, 0.01]
    assert result["median_first_divergence"] == 2  # of 2, 4 (identical), 0
    assert result["mean_first_divergence"] == 2
    assert result["median_reference_top2_gap_at_divergence"] == pytest.approx(0.02)
    assert result["fraction_identical"] == pytest.approx(1 / 3)
    ppl = result["perplexity"]
    assert ppl["reference"] == pytest.approx(math.exp(2.0))
    assert ppl["candidate"] == pytest.approx(math.exp(2.1))
    assert ppl["relative_difference"] == pytest.approx(math.exp(0.1) - 1)
    assert not ppl["within_target"]  # 10.5% off
    assert ppl["top1_agreement"] == pytest.approx(2 / 3)
    assert ppl["mean_abs_logprob_difference"] == pytest.approx(0.1)
    assert ppl["num_tokens"] == 4
    table = format_table(result)
    assert "identical" in table and "OUTSIDE the 1% target" in table
    assert "median first divergence  2 (identical counted as 4)" in table
    assert "identical throughout     1 of 3 prompts (33%)" in table

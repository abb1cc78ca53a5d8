"""Logprob entries for many rows: the definition row by row, and one read back per call."""

from __future__ import annotations

import pytest
import torch

from kvpool.engine.sampling.logprob_entries import logprob_entries
from tests.host_reads import HostReads


def entry_by_definition(row: torch.Tensor, target: int, num_top: int) -> dict[int, tuple]:
    """(log probability, rank) of the target, then of the row's `num_top` best tokens."""
    value = float(row[target])
    entry = {target: (value, int((row > value).sum()) + 1)}
    values, ids = row.topk(num_top) if num_top else (torch.empty(0), torch.empty(0))
    for rank, (top_value, top_id) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
        entry.setdefault(int(top_id), (top_value, rank + 1))
    return entry


@pytest.mark.parametrize("num_tops", [[0, 0, 0, 0], [3, 0, 5, 1], [4, 4, 4, 4]])
def test_entries_follow_the_definition_row_by_row(num_tops):
    logprobs = torch.log_softmax(torch.randn(4, 40, generator=torch.Generator().manual_seed(3)), -1)
    logprobs[3, 7] = logprobs[3, 8] = logprobs[3].max()  # a tie at the top
    targets = [5, int(logprobs[1].argmax()), 39, 8]  # row 1's target is also its best token
    entries = logprob_entries(logprobs, targets, num_tops)
    for row, (entry, target, num_top) in enumerate(zip(entries, targets, num_tops, strict=True)):
        expected = entry_by_definition(logprobs[row], target, num_top)
        assert list(entry) == list(expected), f"row {row}"  # the target first, then by rank
        for token_id, (value, rank) in expected.items():
            assert entry[token_id].rank == rank
            assert entry[token_id].logprob == value  # float32 values come back exactly


def test_one_read_back_per_call_whatever_the_number_of_rows():
    logprobs = torch.log_softmax(torch.randn(16, 100), dim=-1)
    with HostReads() as reads:
        logprob_entries(logprobs, list(range(16)), [2] * 16)
    assert reads.total == 1, reads.counts
    assert logprob_entries(logprobs[:0], [], []) == []

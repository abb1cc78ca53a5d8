"""Prompt lookup's incremental index proposes exactly what a rescan of the whole context
would, however the context grows."""

from __future__ import annotations

from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from kvpool.engine.speculative.ngram import NgramIndex, NgramProposer


def rescan(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The naive lookup: for n from max_n down, the latest earlier occurrence of the suffix."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # occurrences ending before the end
            if tokens[start:start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_proposes_the_continuation_of_the_latest_occurrence():
    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    index = NgramIndex(min_n=2, max_n=3)
    assert index.propose(_slicer(tokens), len(tokens), 2) == [5, 6]


def test_nothing_when_no_suffix_matches():
    tokens = [1, 2, 3, 4]
    assert NgramIndex(2, 3).propose(_slicer(tokens), len(tokens), 3) == []


def test_drafts_stop_at_the_end_of_the_context():
    tokens = [7, 8, 7, 8]  # the match of [7, 8] is at 0; it is followed by 7, 8 only
    assert NgramIndex(2, 2).propose(_slicer(tokens), len(tokens), 5) == [7, 8]


def _slicer(tokens: list[int]):
    return lambda start, end: tokens[start:end]


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
       steps=st.lists(st.integers(1, 6), min_size=1, max_size=12),
       bounds=st.tuples(st.integers(1, 4), st.integers(0, 3)), k=st.integers(1, 6))
def test_incremental_lookup_equals_a_rescan(tokens, steps, bounds, k):
    min_n, max_n = bounds[0], bounds[0] + bounds[1]
    proposer = NgramProposer(min_n, max_n)
    end = 0
    for step in steps:  # the context grows by a few tokens between lookups
        end = min(end + step, len(tokens))
        context = tokens[:end]
        got = proposer.propose(SimpleNamespace(seq_id=0, token_ids=_slicer(tokens),
                                               num_tokens=end), k)
        assert got == rescan(context, min_n, max_n, k)


def test_the_index_reads_only_new_tokens():
    """After the first lookup, a step reads O(new tokens + max_n + k), not the context."""
    tokens = [*range(1000), 5, 6]
    read: list[int] = []

    def counting(start: int, end: int) -> list[int]:
        read.append(end - start)
        return tokens[start:end]

    index = NgramIndex(2, 4)
    index.propose(counting, 1000, 5)
    read.clear()
    assert index.propose(counting, 1002, 5) == [7, 8, 9, 10, 11]
    assert sum(read) <= 2 + 4 + 4 + 5

"""`kvpool bench scale-out`'s workload and report (the processes it starts are the router's
and the servers' own, tested there; a whole run takes minutes and belongs to a benchmark)."""

from __future__ import annotations

import pytest

from kvpool.bench.scale_out import ChatSessions, Turn, report, summarize


def test_the_workload_is_seeded_and_drifts_out_of_lockstep() -> None:
    sessions = ChatSessions(num_sessions=4, num_turns=3, first_words=100, user_words=20)
    messages = sessions.user_messages()
    assert messages == sessions.user_messages()
    assert [len(turns) for turns in messages] == [3] * 4
    first = [len(turns[0].split()) for turns in messages]
    assert all(50 <= words <= 150 for words in first)
    assert len(set(first)) > 1  # not all the same length: sessions do not stay in step
    assert messages != ChatSessions(num_sessions=4, num_turns=3, first_words=100,
                                    user_words=20, seed=1).user_messages()


def _turns(cached_later: int) -> list[Turn]:
    """Two sessions of two turns: 200-token first turns, 260-token second turns, each taking
    0.2 s plus its uncached tokens at 200 tokens/s."""
    turns = []
    for session in range(2):
        turns.append(Turn(session, 0, ttft=0.2 + 200 / 200, prompt_tokens=200,
                          output_tokens=10))
        turns.append(Turn(session, 1, ttft=0.2 + (260 - cached_later) / 200,
                          prompt_tokens=260, cached_tokens=cached_later, output_tokens=10))
    return turns


def test_the_summary_separates_later_turns() -> None:
    result = summarize("prefix", _turns(cached_later=208), wall=4.0, routing={})
    assert result.output_tokens_per_s == pytest.approx(40 / 4.0)
    assert result.later_hit_rate == pytest.approx(208 / 260)
    assert result.first_ttft_ms_p50 == pytest.approx(1200)
    assert result.later_ttft_ms_p50 == pytest.approx(1e3 * (0.2 + 52 / 200))


def test_the_report_compares_with_round_robin_and_projects() -> None:
    results = {"round-robin": summarize("round-robin", _turns(cached_later=0), 4.0, {}),
               "prefix": summarize("prefix", _turns(cached_later=208), 4.0, {})}
    body = report(results)
    speedup = body["configs"]["prefix"]["ttft_p50_speedup"]
    assert speedup == pytest.approx((0.2 + 260 / 200) / (0.2 + 52 / 200))
    projection = body["projection"]
    assert projection["prefill_tokens_per_s"] == pytest.approx(200)
    assert projection["t0_ms"] == pytest.approx(200)
    speedups = [projection[f"{count}_replicas"]["speedup"] for count in (2, 4, 8, 16)]
    assert speedups == sorted(speedups)  # round-robin's chance of a hit falls with N
    assert speedups[0] > 1
